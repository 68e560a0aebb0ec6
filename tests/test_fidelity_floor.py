"""The staleness guard (``fidelity_floor_db``): a displaced step whose stale data moved too far runs in sync."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from exactness import assert_exact
from guard_cases import (
    BUILTIN_DIT,
    agreed_decisions,
    asyncdiff_under_a_floor_measuring,
    calibration_on_ranks_that_see_different_pictures,
    guarded_vs_one_device,
)

from paradiff import ParallelConfig
from paradiff.errors import ParadiffError
from paradiff.fidelity_floor import (
    MARGIN_DB,
    Calibration,
    Kept,
    calibrate,
    kept_calibration,
    remember,
    thresholds_between,
)
from paradiff.runtime.staleness import moved_db
from paradiff.strategies import register, strategy_class, strategy_names, unregister
from paradiff.strategies.base import Strategy

STEPS, SIZE = 8, 128


def test_moved_db_is_the_change_in_db_of_the_latest():
    assert moved_db(torch.ones(4), torch.ones(4) * 1.1) == pytest.approx(20 * math.log10(1.1 / 0.1))
    assert moved_db(torch.ones(4), torch.ones(4)) == math.inf


def test_thresholds_refresh_none_then_the_most_moved_steps_first():
    moved = {1: -math.inf, 2: 10.0, 3: 30.0, 4: 20.0}
    thresholds = thresholds_between(moved)
    refreshed = [{step for step, value in moved.items() if value < t} for t in thresholds]
    assert refreshed == [{1}, {1, 2}, {1, 2, 4}, {1, 2, 3, 4}]


def test_calibration_bisects_to_the_fewest_refreshes_that_hold_the_floor():
    """A fake call whose PSNR grows by 5 dB per refreshed step: the floor 22 needs 5 refreshes (25 >= 22 + margin)."""
    moved = {step: float(step) for step in range(2, 20)}  # step 2 moved most
    runs = []

    def run(threshold):
        runs.append(threshold)
        refreshed = [step for step, value in moved.items() if threshold is None or value < threshold]
        reference = np.zeros((1, 8, 8, 3))
        error = 10 ** (-5 * len(refreshed) / 20)  # PSNR 5 dB per refreshed step
        image = reference + (0 if threshold is None else error)
        return image, {"moved_db": moved, "refreshed_steps": refreshed}

    calibration = calibrate(run, floor_db=22.0 - MARGIN_DB)
    assert calibration.refreshed_steps == (2, 3, 4, 5, 6)
    assert calibration.psnr_db == pytest.approx(25.0)
    assert calibration.runs == len(runs) <= 1 + math.ceil(math.log2(len(moved) + 1))
    assert runs[0] is None  # the reference refreshes every step


def test_a_floor_no_displaced_step_reaches_refreshes_every_step():
    def run(threshold):
        image = np.zeros((1, 4, 4, 3)) + (0.0 if threshold is None else 0.5)
        return image, {"moved_db": {2: 10.0, 3: 20.0}, "refreshed_steps": [2, 3] if threshold is None else []}

    calibration = calibrate(run, floor_db=80.0)
    assert calibration.psnr_db == math.inf and calibration.threshold_db > 20.0


def test_calibrations_are_kept_per_key_with_their_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("PARADIFF_CACHE_DIR", str(tmp_path))
    assert kept_calibration("a") is None
    remember("a", Calibration(12.5, 31.0, (1, 2), 4), {})
    remember("b", Calibration(7.0, math.inf, (), 1), {"asyncdiff_cut": [3, 3]})
    assert kept_calibration("a") == Kept(12.5, {}) and kept_calibration("b") == Kept(7.0, {"asyncdiff_cut": [3, 3]})
    (tmp_path / "fidelity_floor.json").write_text('{"a": {"threshold_db": 12.5}}')  # kept before layouts were
    assert kept_calibration("a") is None
    (tmp_path / "fidelity_floor.json").write_text("{not json")
    assert kept_calibration("a") is None


@pytest.mark.timeout(300)
def test_a_kept_calibration_runs_the_asyncdiff_cut_it_was_measured_on(pool2, tmp_path):
    """The cut decides asyncdiff's pictures, and the one measured follows the machine's timings: a process whose
    timings cut the DiT (2, 4) and finds a threshold calibrated on (3, 3) runs (3, 3), so the floor holds."""
    ran_on = {"asyncdiff_cut": [3, 3]}
    first = pool2.run(asyncdiff_under_a_floor_measuring, (3, 3), 30.0, str(tmp_path))
    assert [r["stats"]["layout"] for r in first] == [ran_on, ran_on] and first[0]["denoiser_calls"] > 8
    kept = pool2.run(asyncdiff_under_a_floor_measuring, (2, 4), 30.0, str(tmp_path))
    assert [r["stats"]["layout"] for r in kept] == [ran_on, ran_on]
    assert [r["denoiser_calls"] for r in kept] == [8, 8]  # no calibration
    assert kept[0]["stats"]["guard"]["threshold_db"] == first[0]["stats"]["guard"]["threshold_db"]
    assert all(r["psnr_db"] >= 30.0 for r in kept), [r["psnr_db"] for r in kept]


@pytest.mark.parametrize("floor", [0, -3, "30", math.inf, True])
def test_a_floor_must_be_a_positive_number_of_db(floor):
    with pytest.raises(ParadiffError, match="fidelity_floor_db must be None or a positive number"):
        ParallelConfig("patch", fidelity_floor_db=floor)


def test_a_floor_makes_the_guard_decide_from_the_first_step_on():
    assert ParallelConfig("patch", fidelity_floor_db=30).warmup_steps == 0
    assert ParallelConfig("patch", fidelity_floor_db=30, warmup_steps=2).warmup_steps == 2
    assert ParallelConfig("patch").warmup_steps == 4


def test_every_displaced_strategy_can_hold_a_floor_and_one_that_cannot_refuses_it():
    displaced = {name for name in strategy_names() if strategy_class(name).uses_warmup}
    assert displaced == {"patch", "pipefusion", "parastep", "asyncdiff", "dualparal"}
    assert all(strategy_class(name).refreshes in ("per call", "itself") for name in displaced)
    ParallelConfig("cfg", fidelity_floor_db=30)  # exact: holds any floor

    class Unguarded(Strategy):
        name = "unguarded"

    register(Unguarded)
    try:
        with pytest.raises(ParadiffError, match="strategy='unguarded' cannot refresh a displaced step yet; use one"):
            ParallelConfig("unguarded", fidelity_floor_db=30)
    finally:
        unregister("unguarded")


@pytest.mark.timeout(120)
def test_ranks_whose_predictions_moved_differently_take_the_same_decision(pool2):
    """Rank 0's prediction moved 40 dB, rank 1's 10 dB: both refresh at a threshold of 20 dB, and agree on 10."""
    results = pool2.run(agreed_decisions, [40.0, 10.0], 20.0)
    assert [r["refresh"] for r in results] == [True, True]
    assert [r["agreed_db"] for r in results] == pytest.approx([10.0, 10.0])
    results = pool2.run(agreed_decisions, [40.0, 30.0], 20.0)
    assert [r["refresh"] for r in results] == [False, False]


def _sync_steps(result: dict, strategy: str, options: dict) -> set[int] | None:
    """The steps this rank ran in sync, read from what it exchanged: `patch` gathers fresh K/V at every layer, and
    so does `pipefusion` in row bands; `pipefusion`'s first stage passes each of the call's 2 samples (CFG's) on
    whole instead of its 4 patches; `asyncdiff`'s first component sends its output to the next only on displaced
    steps."""
    rows = result["stats"]["per_step"]
    if strategy == "pipefusion" and options.get("pipefusion_sync") == "sequence":
        return {row["step"] for row in rows if row["sync_layer_exchanges"]}
    if strategy == "patch":
        return {row["step"] for row in rows if row["sync_layer_exchanges"] and not row["stale_layer_exchanges"]}
    if strategy == "pipefusion":
        return {row["step"] for row in rows if row["stage_transfers"] == 2}
    if strategy == "asyncdiff":
        return set(range(STEPS)) - {row["step"] for row in rows if row["stage_transfers"]}
    return None  # parastep's exchanges do not tell an exact step from a round's first: test_refreshed_steps pins it


@pytest.mark.timeout(120)
def test_ranks_bisect_on_rank_0s_psnr_so_they_calibrate_alike(pool2):
    """Rank 1's pictures 6 dB worse than rank 0's would send its bisection another way (another number of runs, each
    a collective); on rank 0's PSNR both make the same runs and choose the same threshold."""
    results = pool2.run(calibration_on_ranks_that_see_different_pictures)
    assert results[0] == results[1], results


#: Floors the calibration's bisection would leave for one refreshed step or for all only if some PSNR it meets on the
#: way moved 3.7 dB or more (docs/benchmarks.md's run log has them), so that another machine's round-off cannot.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "floor", "options"),
    [
        ("patch", 40.0, {}),
        ("pipefusion", 46.0, {}),
        ("pipefusion", 46.0, {"pipefusion_sync": "sequence"}),
        ("asyncdiff", 37.0, {"asyncdiff_cut": (3, 3)}),
        ("parastep", 52.5, {}),
    ],
    ids=["patch", "pipefusion", "pipefusion-rows", "asyncdiff", "parastep"],
)
def test_the_guard_holds_the_floor_and_refreshes_in_sync(pool2, tmp_path, strategy, floor, options):
    """The built-in DiT at a floor where the guard has a choice: its image holds it; the steps refreshed are those
    the agreed movement puts under the calibrated threshold (and step 1, before two predictions are known), and they
    really ran in sync. ``asyncdiff`` runs a given cut: the one it measures follows the machine's timings, and each
    cut's pictures need another floor for a choice."""
    results = pool2.run(
        guarded_vs_one_device, BUILTIN_DIT, SIZE, STEPS, floor, str(tmp_path), strategy=strategy, **options
    )
    guard = results[0]["stats"]["guard"]
    decided = ("threshold_db", "moved_db", "refreshed_steps", "calibration_runs")
    assert all(
        {key: r["stats"]["guard"][key] for key in decided} == {key: guard[key] for key in decided} for r in results
    )
    refreshed = set(guard["refreshed_steps"])
    assert refreshed == {step for step, moved in guard["moved_db"].items() if moved < guard["threshold_db"]}
    assert 1 in refreshed and 1 < len(refreshed) < STEPS - 1, guard  # a choice: neither warm-up 1 nor every step
    assert _sync_steps(results[0], strategy, options) in ({0} | refreshed, None)
    for result in results:
        assert result["psnr_db"] >= floor, result["psnr_db"]
        assert result["denoiser_calls"] > 2 * STEPS  # the first call calibrated
    if strategy == "pipefusion":
        assert "fidelity_floor_db" in results[0]["stats"]["flow"]["stopped"]
    again = pool2.run(
        guarded_vs_one_device, BUILTIN_DIT, SIZE, STEPS, floor, str(tmp_path), strategy=strategy, **options
    )
    assert [r["denoiser_calls"] for r in again] == [STEPS, STEPS]  # kept: no calibration
    assert again[0]["stats"]["guard"]["threshold_db"] == guard["threshold_db"]


@pytest.mark.timeout(300)
def test_a_floor_above_any_displaced_step_is_exact(pool2, tmp_path):
    results = pool2.run(
        guarded_vs_one_device, BUILTIN_DIT, SIZE, STEPS, 300.0, str(tmp_path), "latent", strategy="patch"
    )
    assert_exact(results, "floor 300 dB")
    assert results[0]["stats"]["guard"]["refreshed_steps"] == list(range(1, STEPS))


@pytest.mark.timeout(300)
def test_after_a_refresh_bucketed_and_direct_transfers_carry_the_same_data(pool2, tmp_path):
    """A displaced step after a refreshed one reads the refresh's data, whether its pieces travel in one bucket per
    call (huge limit) or on their own (limit 0): the two runs are equal. The threshold (as if kept from an earlier
    calibration) refreshes steps 2 and 3 of the displaced ones: they move the most after step 1's."""
    direct, bucketed = (
        pool2.run(
            guarded_vs_one_device,
            BUILTIN_DIT,
            SIZE,
            STEPS,
            50.0,
            str(tmp_path),
            kept_threshold=7.0,
            bucket_limit_bytes=limit,
        )
        for limit in (0, 1 << 40)
    )
    for results in (direct, bucketed):
        assert results[0]["stats"]["guard"]["refreshed_steps"] == [1, 2, 3], results[0]["stats"]["guard"]
        assert _sync_steps(results[0], "patch", {}) == {0, 1, 2, 3}
    np.testing.assert_array_equal(direct[0]["image"], bucketed[0]["image"])
