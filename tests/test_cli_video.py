"""`paradiff generate` writes the built-in video model's clips as GIF when asked, draws fewer frames when asked, and
refuses more than its motion modules hold.

Every strategy that runs the video model, on 2 ranks, is a cell of tests/test_command_matrix.py.
"""

from __future__ import annotations

import pytest
from PIL import Image

from paradiff.builtin import FRAMES
from paradiff.cli import main

PROMPT = "a large red circle moving from left to right on a white background"
ONE_RANK = ["--model", "paradiff-tiny-video", "--nproc", "1", "--steps", "2", "--size", "64"]


@pytest.mark.timeout(200)
def test_a_gif_when_asked_fewer_frames_when_asked_and_a_clear_refusal_of_more(tmp_path, capsys):
    out = tmp_path / "clip.gif"
    assert main(["generate", PROMPT, *ONE_RANK, "--out", str(out)]) == 0
    with Image.open(out) as gif:
        assert gif.format == "GIF" and gif.n_frames == FRAMES and gif.size == (64, 64)
    fewer = tmp_path / "fewer.gif"
    assert main(["generate", PROMPT, *ONE_RANK, "--frames", "8", "--out", str(fewer)]) == 0
    with Image.open(fewer) as gif:
        assert gif.n_frames == 8
    capsys.readouterr()
    assert main(["generate", PROMPT, *ONE_RANK, "--frames", str(FRAMES + 1), "--out", str(tmp_path / "more.gif")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"draws at most {FRAMES} frames (its motion modules' motion_max_seq_length); use --frames {FRAMES}" in err
    assert not (tmp_path / "more.gif").exists()
