"""How far the built-in VAE's latents put each shape colour from each background: the contrast a denoiser has to
reproduce for a shape to show.

    python benchmarks/latent_contrast.py                 # the shipped VAE (paradiff/builtin/paradiff-tiny/sd/vae)
    python benchmarks/latent_contrast.py --vae DIR/sd/vae   # another one, e.g. a training run's

Each colour is drawn as a large square in the centre of each background, as the training scenes draw shapes, and
encoded (the latent mean, scaled as the denoisers see it); the table gives the distance (over the latent channels)
between the latents inside the square and those in the picture's corners. A flat patch of one colour alone is no
measure: this VAE never saw one, and decodes a flat yellow patch's latents as white. A denoiser's loss counts an
error in proportion to the square of that distance, so a pair the VAE puts close together is one the denoisers learn
to tell apart last. Prints the table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL

from paradiff.builtin import WEIGHTS
from paradiff.builtin.scenes import BACKGROUNDS, COLOURS, Scene, Shape
from paradiff.builtin.train import to_pixels

#: The picture's side (px), and the latent windows (rows and columns alike) read inside the square and in a corner.
SIDE, INSIDE, CORNER = 256, slice(13, 19), slice(1, 5)


@torch.no_grad()
def square_latents(vae: AutoencoderKL, colour: str, background: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled latent means inside a large ``colour`` square centred on ``background``, and in the corner: one
    vector of channels each."""
    scene = Scene((Shape("square", colour, "large", "in the center"),), background, "", ((0.0, 0.0),))
    means = vae.encode(to_pixels(np.stack([scene.draw(SIDE)]))).latent_dist.mean[0] * vae.config.scaling_factor
    return means[:, INSIDE, INSIDE].mean((1, 2)), means[:, CORNER, CORNER].mean((1, 2))


def contrasts(vae: AutoencoderKL) -> dict[str, dict[str, float]]:
    """Shape colour -> background -> the distance between the latents inside the square and around it."""
    table = {}
    for colour in COLOURS:
        table[colour] = {}
        for background in BACKGROUNDS:
            inside, corner = square_latents(vae, colour, background)
            table[colour][background] = float((inside - corner).norm())
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", type=Path, default=WEIGHTS / "sd" / "vae", help="a VAE folder")
    parser.add_argument("--out", type=Path, default=Path("latent_contrast.json"))
    args = parser.parse_args(argv)
    table = contrasts(AutoencoderKL.from_pretrained(args.vae).eval())
    print("| shape colour | " + " | ".join(f"on {name}" for name in BACKGROUNDS) + " |")
    print("|---|" + "---|" * len(BACKGROUNDS))
    for colour, row in table.items():
        print(f"| {colour} | " + " | ".join(f"{row[name]:.2f}" for name in BACKGROUNDS) + " |")
    args.out.write_text(json.dumps({"vae": str(args.vae), "contrast": table}, indent=1))


if __name__ == "__main__":
    main()
