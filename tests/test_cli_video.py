"""`paradiff generate` makes videos with the built-in video model under every strategy that runs it on CPU."""

from __future__ import annotations

import pytest
from test_cli import cli_env, run_cli

from paradiff.builtin import FRAMES
from paradiff.strategies import strategy_class, strategy_names

PROMPT = "a large red circle moving from left to right on a white background"


def cpu_strategies_for_latte() -> list[str]:
    """The strategies that run Latte (the built-in video model's denoiser), less ``ring`` (CUDA only)."""
    from paradiff.models import FAMILIES

    family = next(family for family in FAMILIES if "LatteTransformer3DModel" in family.class_names)
    return [name for name in strategy_names() if name != "ring" and strategy_class(name).supports(family)]


def test_every_strategy_that_runs_latte_is_tried():
    assert set(cpu_strategies_for_latte()) >= {"patch", "cfg", "parastep", "asyncdiff", "ulysses"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", cpu_strategies_for_latte())
def test_a_16_frame_mp4_from_each_strategy_at_2_ranks(tmp_path, strategy):
    import imageio.v3 as iio

    out = tmp_path / "clip.mp4"
    argv = ["--model", "paradiff-tiny-video", "--frames", str(FRAMES), "--steps", "4", "--no-baseline"]
    done = run_cli("generate", PROMPT, *argv, "--strategy", strategy, "--out", str(out), env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert iio.imread(out).shape == (FRAMES, 256, 256, 3)
    assert done.stdout.splitlines()[0] == f"wrote {out}"
    assert any(line.startswith(f"2 ranks, {strategy}: ") for line in done.stdout.splitlines()), done.stdout


@pytest.mark.timeout(200)
def test_a_gif_when_asked_and_a_clear_refusal_of_other_frame_counts(tmp_path):
    from PIL import Image

    out = tmp_path / "clip.gif"
    argv = ["--model", "paradiff-tiny-video", "--steps", "2", "--size", "128", "--nproc", "1"]
    done = run_cli("generate", PROMPT, *argv, "--out", str(out), env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    with Image.open(out) as gif:
        assert gif.format == "GIF" and gif.n_frames == FRAMES and gif.size == (128, 128)
    refused = run_cli("generate", PROMPT, "--model", "paradiff-tiny-video", "--frames", "8", env=cli_env(tmp_path))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"draws {FRAMES} frames (its transformer's video_length); use --frames {FRAMES}" in refused.stderr
