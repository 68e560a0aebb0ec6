"""Multi-rank task functions for the staleness guard's tests (``fidelity_floor_db``), run on every rank of a pool."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from patch_cases import against_one_device

from paradiff.builtin import call_kwargs
from paradiff.loading import load_pipeline
from paradiff.pipeline import ParallelState
from paradiff.runtime.comm import Communicator
from paradiff.runtime.distributed import RankGroup
from paradiff.runtime.staleness import StalenessGuard
from paradiff.runtime.step_state import StepState
from paradiff.tiny import build_pipeline, prompt_inputs

#: The built-in DiT: trained, so its pictures show what stale activations cost (a random model's barely do).
BUILTIN_DIT = "paradiff-tiny-dit"
PROMPT = "a large red circle at the top left"


def guarded_vs_one_device(
    family: str,
    size: int,
    steps: int,
    floor: float,
    cache: str,
    output_type: str = "np",
    kept_threshold: float | None = None,
    **options,
) -> dict:
    """One device, then ``parallelize(pipe, fidelity_floor_db=floor, **options)`` with its calibration kept in
    ``cache`` (or, with ``kept_threshold``, found there as that threshold); ``denoiser_calls`` counts the parallel
    pipeline's denoiser calls (calibration runs included)."""
    import os

    os.environ["PARADIFF_CACHE_DIR"] = cache
    if family == BUILTIN_DIT:
        pipe = load_pipeline(BUILTIN_DIT)
        inputs = call_kwargs("pixart", PROMPT, warn=False)
    else:
        pipe = build_pipeline(family)
        inputs = prompt_inputs(pipe, family)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    reference_calls = steps  # one call per step on one device (batched CFG)
    kept = mock.patch.object(ParallelState, "threshold", return_value=kept_threshold) if kept_threshold else None
    with kept or contextlib.nullcontext():
        result = against_one_device(
            pipe, inputs, size, steps, fidelity_floor_db=floor, output_type=output_type, **options
        )
    result["denoiser_calls"] = len(calls) - 2 * reference_calls  # less the one-device and the restored runs
    return result


def agreed_decisions(moved_by_rank: list[float], threshold_db: float) -> dict:
    """Each rank's guard sees predictions that moved by its own share; what each decides for the next step."""
    comm = Communicator(RankGroup.world(timedelta(seconds=60)), StepState(0))
    guard = StalenessGuard(comm, threshold_db)
    guard.begin()
    base = torch.ones(64)
    share = 10 ** (-moved_by_rank[dist.get_rank()] / 20)  # |Δ| / |p| for that many dB
    guard.observe(0, base * (1 + share))
    guard.observe(1, base)
    refresh = guard.decide(2)
    return {"refresh": refresh, "agreed_db": guard.counters.moved_db[2]}


def calibration_on_ranks_that_see_different_pictures() -> dict:
    """:func:`~paradiff.fidelity_floor.calibrate` where rank 1's pictures are 6 dB worse than rank 0's, bisecting on
    rank 0's PSNR as ``parallelize`` does: what each rank chose, and how many runs it made."""
    from paradiff.fidelity_floor import calibrate

    comm = Communicator(RankGroup.world(timedelta(seconds=60)), StepState(0))
    moved = {step: float(step) for step in range(2, 20)}
    worse = 2.0 if dist.get_rank() == 1 else 1.0  # twice the error: 6 dB lower

    def run(threshold):
        refreshed = [step for step, value in moved.items() if threshold is None or value < threshold]
        error = 0.0 if threshold is None else worse * 10 ** (-5 * len(refreshed) / 20)
        return torch.full((1, 8, 8, 3), error).numpy(), {"moved_db": moved, "refreshed_steps": refreshed}

    calibration = calibrate(run, 21.0, lambda psnr_db: comm.all_gather_object(psnr_db)[0])
    return {"threshold_db": calibration.threshold_db, "runs": calibration.runs}


def asyncdiff_under_a_floor_measuring(cut: tuple[int, ...], floor: float, cache: str) -> dict:
    """:func:`guarded_vs_one_device` for ``asyncdiff`` on the built-in DiT whose timings would cut it as ``cut``
    (the balancing made to choose it); ``comm_stats``' ``layout`` says the cut it ran."""
    with mock.patch("paradiff.strategies.asyncdiff.balanced_cut", return_value=cut):
        return guarded_vs_one_device(BUILTIN_DIT, 128, 8, floor, cache, strategy="asyncdiff")
