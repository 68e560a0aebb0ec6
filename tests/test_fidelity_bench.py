"""``benchmarks/fidelity_bench.py``'s own pieces: the count of prompts under a floor, and the prompts it draws."""

from __future__ import annotations

import pytest
from benchmark_scripts import BENCHMARKS, load_script


@pytest.fixture
def fidelity_bench(monkeypatch):
    """The script as its command runs it: its folder first on the path, for the helpers beside it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return load_script("fidelity_bench")


def test_prompts_under_a_floor_are_counted_only_for_a_guarded_row(fidelity_bench):
    per_prompt = [{"psnr_db": 29.5}, {"psnr_db": 30.0}, {"psnr_db": float("inf")}]
    assert fidelity_bench.under_floor({"fidelity_floor_db": 30, "per_prompt": per_prompt}) == "1 of 3"
    assert fidelity_bench.under_floor({"fidelity_floor_db": None, "per_prompt": per_prompt}) == ""


def test_held_out_prompts_refuse_a_prompt_count(fidelity_bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["fidelity_bench.py", "--held-out", "--prompts", "3"])
    with pytest.raises(SystemExit) as exited:
        fidelity_bench.main()
    assert exited.value.code == 2 and "leave out --prompts" in capsys.readouterr().err
