"""Single-process units of the runtime: step counting, band geometry, fidelity metric."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paradiff.metrics import psnr
from paradiff.runtime.distributed import TAG_LIMIT, TagCounter
from paradiff.runtime.step_state import RowPartition, StepState


def test_steps_follow_timestep_changes_per_context():
    state = StepState(warmup_steps=1)
    state.begin_run()
    seen = []
    for context, timestep in [("cond", 999), ("uncond", 999), ("cond", 900), ("uncond", 900), ("cond", 800)]:
        state.enter_call(context, torch.tensor([timestep, timestep]))
        seen.append((state.context, state.step, state.call_in_step, state.synchronous))
    assert seen == [
        ("cond", 0, 0, True),
        ("uncond", 0, 0, True),
        ("cond", 1, 0, True),
        ("uncond", 1, 0, True),
        ("cond", 2, 0, False),
    ]


def test_second_call_at_same_timestep_gets_its_own_slot():
    state = StepState(warmup_steps=0)
    state.begin_run()
    for timestep in (999, 999, 900, 900):
        state.enter_call(None, timestep)
    assert (state.step, state.call_in_step) == (1, 1)
    made = []
    buffer = state.exchange("layer", lambda: made.append(1) or object())
    assert state.exchange("layer", lambda: None) is buffer and made == [1]
    state.enter_call(None, 800)
    assert state.exchange("layer", lambda: "slot 0") == "slot 0"


def test_begin_run_forgets_everything():
    state = StepState(warmup_steps=0)
    state.begin_run()
    state.enter_call(None, 5)
    state.exchange("layer", object)
    state.begin_run()
    assert state.buffers == {} and state.step == -1
    state.enter_call(None, 5)
    assert state.step == 0 and state.synchronous


def test_row_partition_geometry():
    part = RowPartition(rows=64, cols=48, parts=4, rank=2)
    assert (part.band_rows, part.row_start, part.band_tokens) == (16, 32, 768)
    assert part.cols_for_band_tokens(768 // 4) == 24  # one level down: half the rows and half the cols
    with pytest.raises(RuntimeError):
        part.cols_for_band_tokens(100)


def test_psnr():
    a = np.zeros((4, 4, 3))
    assert math.isinf(psnr(a, a))
    assert psnr(a + 0.1, a) == pytest.approx(20.0)


def test_call_tags_come_round_again_after_the_whole_range_but_never_onto_lasting_tags():
    tags = TagCounter()
    assert tags.reserve(3, lasting=True) == range(1, 4)  # a layer's own, for the whole installation
    assert tags.reserve(2, lasting=False) == range(4, 6)
    assert tags.reserve(4, lasting=False) == range(6, 10)  # never the same twice in a row
    tags.next = TAG_LIMIT - 1
    assert tags.reserve(5, lasting=False) == range(4, 9)  # past the end: back to the first call tag
    with pytest.raises(RuntimeError, match="lasting message tags are reserved at install time"):
        tags.reserve(1, lasting=True)
