"""``benchmarks/gpu_strategies.py``'s verdicts, without a GPU or ranks: a refused strategy is its own outcome, never
a pass, and the exit code says when a requested strategy did not run."""

from __future__ import annotations

import json
import sys

import pytest
from benchmark_scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "gpu_strategies.py"


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_strategies")


def ran(strategy: str, exact: bool = True) -> dict:
    """A row as ``on_rank`` returns it for a case that ran."""
    relative = 1e-7 if exact else 0.3
    return {
        "strategy": strategy,
        "family": "pixart",
        "dtype": "float32",
        "device": "cuda:0",
        "relative_difference": relative,
        "ranks_equal": True,
        "exact": exact,
    }


def refused(strategy: str) -> dict:
    """A row as ``on_rank`` returns it for a case ``parallelize`` refused."""
    return {"strategy": strategy, "family": "pixart", "dtype": "bfloat16", "device": "cpu", "refused": "no LSE"}


def test_a_refused_strategy_is_neither_a_pass_nor_a_failure(script):
    assert [script.outcome(row) for row in (ran("cfg"), ran("patch", exact=False), refused("ring"))] == [
        "exact",
        "not exact",
        "refused",
    ]
    names = ["cfg", "ulysses", "ring"]
    assert script.exit_code([ran("cfg"), ran("ulysses"), ran("ring")], names) == script.PASSED == 0
    assert script.exit_code([ran("cfg"), ran("ulysses"), refused("ring")], names) == script.NOT_ALL_RAN != 0
    assert script.exit_code([ran("cfg"), ran("ulysses")], names) == script.NOT_ALL_RAN  # a strategy with no row
    assert script.exit_code([ran("cfg"), ran("ulysses", exact=False), refused("ring")], names) == script.FAILED
    assert len({script.PASSED, script.FAILED, script.NOT_ALL_RAN, 2}) == 4  # 2 is argparse's usage error
    line = script.row_line(refused("ring"))
    assert "REFUSED" in line and "exact" not in line.lower()
    assert script.summary([ran("cfg"), refused("ring")], names) == (
        "1 of 3 exact, 0 not exact, 1 refused, no result for ulysses"
    )


def test_the_script_exits_not_all_ran_when_a_requested_strategy_is_refused(script, monkeypatch, tmp_path, capsys):
    """``main`` end to end, with the ranks' rows made by hand: the table, the JSON and the exit code."""
    import paradiff.launch

    rows = [ran("cfg"), refused("ring")]
    monkeypatch.setattr(paradiff.launch, "run_on_ranks", lambda fn, nproc, device_name, names, device: rows)
    out = tmp_path / "gpu_strategies.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--strategies", "cfg,ring", "--out", str(out)])
    assert script.main() == script.NOT_ALL_RAN
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("ring") and "REFUSED" in printed[1]
    assert printed[-1] == "1 of 2 exact, 0 not exact, 1 refused"
    assert [row["outcome"] for row in json.loads(out.read_text())] == ["exact", "refused"]
