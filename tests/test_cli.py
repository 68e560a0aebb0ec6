"""`paradiff generate` end to end on 2 ranks, its bad-input messages, and the from_pretrained path."""

from __future__ import annotations

import subprocess
import sys

import pytest
from PIL import Image

from paradiff.cli import main
from paradiff.loading import load_pipeline
from paradiff.tiny import build_pipeline, prompt_inputs


@pytest.mark.timeout(300)
def test_generate_on_two_ranks(tmp_path):
    out = tmp_path / "circle.png"
    command = [sys.executable, "-m", "paradiff.cli", "generate", "a red circle", "--model", "random-sd", "--size", "128", "--steps", "3"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (128, 128) and image.mode == "RGB"
    assert "latency:" in done.stdout and "speedup" in done.stdout and "on 2 rank(s)" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1"),
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
