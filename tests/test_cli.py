"""`paradiff generate` end to end on 2 ranks, its bad-input messages, and the from_pretrained path."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from scene_analysis import background_of
from video_pipeline import save_tiny_cogvideox

from paradiff.cli import main
from paradiff.loading import load_pipeline
from paradiff.tiny import build_pipeline, prompt_inputs


def run_cli(*argv: str, timeout: int = 280) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "paradiff.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_generate_on_two_ranks_with_the_builtin_model(tmp_path):
    out = tmp_path / "circle.png"
    done = run_cli("generate", "a large red circle at the top left on a black background", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (128, 128) and image.mode == "RGB"
        assert background_of(np.asarray(image)) == "black", "the picture follows the prompt"
    assert "latency:" in done.stdout and "speedup" in done.stdout and "on 2 rank(s)" in done.stdout
    assert done.stdout.count("wrote ") == 1


@pytest.mark.timeout(300)
def test_a_size_the_strategy_cannot_split_is_a_clear_error(tmp_path):
    done = run_cli("generate", "a red circle", "--size", "200", "--steps", "2", "--out", str(tmp_path / "x.png"))
    assert done.returncode == 2
    assert "paradiff: error: height 200" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.timeout(120)
def test_video_pipelines_write_mp4(tmp_path, capsys):
    import imageio.v3 as iio

    folder = save_tiny_cogvideox(tmp_path / "cogvideox")
    out = tmp_path / "clip.png"
    argv = ["a red circle", "--model", str(folder), "--nproc", "1", "--steps", "2", "--frames", "5", "--size", "32"]
    assert main(["generate", *argv, "--out", str(out)]) == 0
    frames = iio.imread(tmp_path / "clip.mp4")
    assert frames.shape == (8, 32, 32, 3), "5 frames round up to CogVideoX's 4k + 1 latent frames: 8 decoded"
    assert not out.exists() and "writing" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--size", "100"], "--size must be a positive multiple of 8, got 100"),
        (["--frames", "0"], "--frames must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--out", "/nonexistent/dir/x.png"], "cannot write /nonexistent/dir/x.png"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    ],
)
def test_bad_input(capsys, argv, message):
    assert main(["generate", "a prompt", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_strategy_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "a prompt", "--strategy", "tiles"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tiles'" in capsys.readouterr().err


def test_from_pretrained_on_a_local_folder(tmp_path):
    built = build_pipeline("sd")
    built.save_pretrained(tmp_path)
    loaded = load_pipeline(str(tmp_path))
    assert type(loaded) is type(built)
    inputs = prompt_inputs(loaded, "sd")
    images = loaded(**inputs, height=64, width=64, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)
