"""Transfers staged through host memory, as gloo needs for CUDA tensors, checked on CPU ranks.

``PARADIFF_STAGE_HOST=1`` makes the communicator stage CPU tensors through separate host buffers exactly as
it stages CUDA tensors on gloo: what a transfer receives lands in a host buffer and reaches the caller's
tensor only when the transfer is waited for. Every exchange then gives what it gives unstaged, and every
strategy's image is the same bit for bit.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from patch_cases import generate

import paradiff
from paradiff.errors import ParadiffError
from paradiff.runtime.comm import STAGE_HOST_VARIABLE, Communicator
from paradiff.runtime.distributed import BACKEND_VARIABLE, RankGroup, backend_for
from paradiff.runtime.step_state import StepState
from paradiff.tiny import build_pipeline, prompt_inputs


class _Staged:
    """``PARADIFF_STAGE_HOST=1`` for the block (in this worker process)."""

    def __enter__(self):
        os.environ[STAGE_HOST_VARIABLE] = "1"

    def __exit__(self, *_):
        os.environ.pop(STAGE_HOST_VARIABLE, None)


def staged_exchanges() -> dict:
    """Each kind of exchange once, staged; what the receiving tensors held before and after the wait."""
    rank = dist.get_rank()
    with _Staged():
        comm = Communicator(RankGroup.world(timedelta(seconds=60)), StepState(warmup_steps=0))
    mine = torch.arange(4, dtype=torch.float32) + 10 * rank
    seen = {"staged": comm.stages_through_host and comm.stages_every_tensor}

    pieces = [torch.full((4,), -1.0) for _ in range(2)]
    transfer, _ = comm.all_gather(pieces, mine)
    dist.barrier()
    seen["gather_before_wait"] = torch.cat(pieces).tolist()
    comm.wait([transfer])
    seen["gather"] = torch.cat(pieces).tolist()

    tag = comm.tags(1)[0]
    if rank == 0:
        comm.wait([comm.send(mine, 1, tag)[0]])
    else:
        buffer = torch.full((4,), -1.0)
        comm.wait([comm.receive(buffer, 0, tag)])
        seen["received"] = buffer.tolist()

    shared = mine.clone()
    comm.wait([comm.broadcast(shared, 1)[0]])
    seen["broadcast"] = shared.tolist()
    seen["reduced"] = comm.all_reduce(mine.clone()).tolist()

    top, bottom = mine[:2].clone(), mine[2:].clone()
    above = torch.full((2,), -1.0) if rank == 1 else None
    below = torch.full((2,), -1.0) if rank == 0 else None
    tags = tuple(comm.tags(2))
    works, _ = comm.swap_with_neighbours((top, bottom), (above, below), tags)
    comm.wait(works)
    seen["from_neighbour"] = (above if rank == 1 else below).tolist()
    return seen


@pytest.mark.timeout(120)
def test_every_exchange_arrives_through_host_buffers(pool2):
    results = pool2.run(staged_exchanges)
    zero, one = [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]
    for rank, seen in enumerate(results):
        assert seen["staged"]
        assert seen["gather_before_wait"] == [-1.0] * 8, "a staged receive reached the tensor before the wait"
        assert seen["gather"] == zero + one
        assert seen["broadcast"] == one
        assert seen["reduced"] == [a + b for a, b in zip(zero, one, strict=True)]
        assert seen["from_neighbour"] == ([2.0, 3.0] if rank == 1 else [10.0, 11.0])  # the other's facing rows
    assert results[1]["received"] == zero


def staged_against_unstaged(family: str, size: int, steps: int, **options) -> dict:
    """The image of ``parallelize(pipe, **options)`` without staging, then with every transfer staged."""
    pipe = build_pipeline(family)
    inputs = prompt_inputs(pipe, family)
    images = []
    for staged in (False, True):
        os.environ.pop(STAGE_HOST_VARIABLE, None)
        if staged:
            os.environ[STAGE_HOST_VARIABLE] = "1"
        try:
            pipe = paradiff.parallelize(pipe, **options)
            images.append(generate(pipe, inputs, size, steps))
            stats = paradiff.comm_stats(pipe)
        finally:
            os.environ.pop(STAGE_HOST_VARIABLE, None)
            paradiff.unparallelize(pipe)
    return {"difference": float(np.abs(images[1] - images[0]).max()), "bytes": stats["bytes_per_step"]}


STRATEGIES = [
    ("sd", dict(strategy="patch", warmup_steps=1)),  # halos, GroupNorm statistics, K/V: bucketed and direct
    ("pixart", dict(strategy="pipefusion", warmup_steps=1, pipefusion_stages=(1, 1))),
    ("sd", dict(strategy="asyncdiff", warmup_steps=1, asyncdiff_cut=(5, 2))),
    ("pixart", dict(strategy="parastep", warmup_steps=1)),
    ("sd", dict(strategy="cfg")),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "options"), STRATEGIES, ids=[o["strategy"] for _, o in STRATEGIES])
def test_staged_transfers_give_the_same_image(pool2, family, options):
    for result in pool2.run(staged_against_unstaged, family, 64, 4, **options):
        assert result["bytes"] > 0
        assert result["difference"] == 0.0


def test_the_backend_follows_the_device_unless_asked(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    assert (backend_for(cuda), backend_for(cpu)) == ("nccl", "gloo")
    monkeypatch.setenv(BACKEND_VARIABLE, "gloo")
    assert (backend_for(cuda), backend_for(cpu)) == ("gloo", "gloo")
    monkeypatch.setenv(BACKEND_VARIABLE, "nccl")
    with pytest.raises(ParadiffError, match="needs CUDA ranks"):
        backend_for(cpu)
    monkeypatch.setenv(BACKEND_VARIABLE, "mpi")
    with pytest.raises(ParadiffError, match="use auto, nccl or gloo"):
        backend_for(cuda)
