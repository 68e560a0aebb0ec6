"""Ranks that disagree on what they run fail together, naming what differs and the rank that differs."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from disagreement_cases import CALL_CASES, SETUP_CASES, disagree

from paradiff.runtime.consensus import describe, describe_call, disagreement


@pytest.mark.parametrize("case", list(CALL_CASES))
def test_a_call_that_differs_on_one_rank_fails_on_every_rank(pool2, case):
    messages = pool2.run(disagree, case, timeout_s=120)
    assert messages[0] == messages[1], "every rank raises the same error"
    assert messages[0].startswith("ranks disagree on the call's arguments: "), messages[0]
    assert f"{case if case != 'cfg' else 'guidance_scale'} differs: " in messages[0]
    assert "(rank 0)" in messages[0] and "(rank 1)" in messages[0]


@pytest.mark.parametrize("case", SETUP_CASES)
def test_a_setup_that_differs_on_one_rank_fails_at_parallelize(pool2, case):
    messages = pool2.run(disagree, case, timeout_s=120)
    assert messages[0] == messages[1]
    assert messages[0].startswith("ranks disagree on what parallelize() runs: "), messages[0]
    named = {"weights": "unet weights differs", "dtype": "unet differs", "model": "pipeline differs"}
    assert named.get(case, f"{case} differs") in messages[0], messages[0]


def test_descriptions_differ_whenever_values_do():
    tensor = torch.arange(6.0).view(2, 3)
    assert describe(tensor) != describe(tensor + 1e-6)
    assert describe(tensor) != describe(tensor.view(3, 2))
    assert describe(tensor) == describe(tensor.clone())
    assert describe(tensor, content=False) == describe(tensor + 1, content=False)
    assert describe(np.zeros(3)) != describe(np.ones(3))
    assert describe("x" * 100) != describe("x" * 99 + "y") and len(describe("x" * 100)) < 90
    assert describe({"scale": 1.0}) != describe({"scale": 1.5})
    assert describe([1, 2.0, None]) == "[1, 2.0, None]"


def test_a_call_is_described_with_its_defaults():
    def call(self, prompt=None, guidance_scale=7.5, **kwargs):
        pass

    class Pipe:
        dtype = torch.float16

    signature = inspect.signature(call)
    given, defaulted = (
        describe_call(signature, Pipe(), ("a cat",), {"guidance_scale": 7.5}),
        describe_call(signature, Pipe(), (), {"prompt": "a cat"}),
    )
    assert given == defaulted and given["pipeline dtype"] == "torch.float16"
    assert describe_call(signature, Pipe(), (), {"extra": 1})["extra"] == "1"


def test_disagreement_groups_ranks_by_value():
    text = disagreement([{"a": "1", "b": "x"}, {"a": "2", "b": "x"}, {"a": "1"}])
    assert text == "a differs: 1 (ranks 0, 2), 2 (rank 1); b differs: x (ranks 0, 1), not given (rank 2)"
