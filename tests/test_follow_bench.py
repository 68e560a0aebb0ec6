"""``benchmarks/follow_bench.py``, the command the docs' follow rates come from: it draws the asked prompts, and the
rates it prints and writes are the follow measure's reading of those pictures; ``--seen`` with the video model is
refused before anything is loaded."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_script

from paradiff.builtin.follow import CHECKS
from paradiff.builtin.scenes import SEEN_PROMPTS


@pytest.fixture(scope="module")
def follow_bench():
    return load_script("follow_bench")


@pytest.mark.timeout(120)
def test_a_quick_run_on_the_seen_prompts_writes_the_rates_of_the_pictures_it_drew(follow_bench, tmp_path, capsys):
    """``--quick --seen``: 4 seen prompts, seed 0, 4 steps. Each rate is the share of pictures not missing that check,
    and the printed row is the written one."""
    out = tmp_path / "follow.json"
    follow_bench.main(["--models", "paradiff-tiny", "--quick", "--seen", "--out", str(out)])
    result = json.loads(out.read_text())["results"][0]
    assert result["prompts"] == list(SEEN_PROMPTS[:4]) and result["drawn"] == 4
    missed = list(result["misses"].values())
    expected = {check: 1 - sum(check in checks for checks in missed) / 4 for check in CHECKS}
    assert result["rates"] == pytest.approx(expected | {"all": 1 - len(missed) / 4})
    shares = " | ".join(f"{100 * result['rates'][check]:.0f}%" for check in (*CHECKS, "all"))
    assert f"| paradiff-tiny | 128 px | 2 | 4 | {shares} |" in capsys.readouterr().out


def test_seen_prompts_with_the_video_model_are_refused_before_any_pipeline_loads(follow_bench, monkeypatch, tmp_path):
    monkeypatch.setattr(follow_bench, "load_pipeline", lambda model: pytest.fail(f"loaded {model}"))
    out = tmp_path / "follow.json"
    with pytest.raises(SystemExit) as refused:
        follow_bench.main(["--models", "paradiff-tiny,paradiff-tiny-video", "--seen", "--out", str(out)])
    assert refused.value.code == 2 and not out.exists()
