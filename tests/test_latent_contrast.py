"""``benchmarks/latent_contrast.py``: it reads the latents inside the square and in the corner (with a stand-in VAE
whose latents are pixels), and the table it prints and writes holds their distance for every pair."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F
from benchmark_scripts import load_script
from diffusers import AutoencoderKL

from paradiff.builtin import WEIGHTS
from paradiff.builtin.scenes import BACKGROUNDS, COLOURS


@pytest.fixture(scope="module")
def script():
    return load_script("latent_contrast")


@pytest.fixture(scope="module")
def vae():
    return AutoencoderKL.from_pretrained(WEIGHTS / "sd" / "vae").eval()


class PoolingVAE:
    """A stand-in whose latents are the picture's pixels averaged over 8x8 blocks, scaled by 2."""

    config = types.SimpleNamespace(scaling_factor=2.0)

    def encode(self, pixels):
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mean=F.avg_pool2d(pixels, 8)))


@pytest.mark.parametrize(("colour", "background"), [("yellow", "white"), ("purple", "gray"), ("green", "black")])
def test_the_latents_are_read_inside_the_square_and_in_the_corner(script, colour, background):
    inside, corner = script.square_latents(PoolingVAE(), colour, background)
    for read, rgb in ((inside, COLOURS[colour]), (corner, BACKGROUNDS[background])):
        torch.testing.assert_close(read, 2 * (torch.tensor(rgb, dtype=torch.float32) / 127.5 - 1), atol=1e-5, rtol=0)


def test_the_table_holds_every_colour_against_every_background_as_printed(script, vae, tmp_path, capsys):
    out = tmp_path / "contrast.json"
    script.main(["--out", str(out)])
    table = json.loads(out.read_text())["contrast"]
    assert set(table) == set(COLOURS) and all(set(row) == set(BACKGROUNDS) for row in table.values())
    printed = capsys.readouterr().out
    for colour, row in table.items():
        assert f"| {colour} | " + " | ".join(f"{row[name]:.2f}" for name in BACKGROUNDS) + " |" in printed
    inside, corner = script.square_latents(vae, "yellow", "white")
    assert table["yellow"]["white"] == pytest.approx(float((inside - corner).norm()), rel=1e-5)
