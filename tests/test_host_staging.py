"""Transfers staged through host memory, as gloo needs for CUDA tensors, checked on CPU ranks.

``PARADIFF_STAGE_HOST=1`` makes the communicator stage CPU tensors through separate host buffers exactly as
it stages CUDA tensors on gloo: what a transfer receives lands in a host buffer and reaches the caller's
tensor only when the transfer is waited for. Every exchange then gives what it gives unstaged, and every
strategy's image is the same bit for bit; a spy on torch.distributed checks that what it moved were the host
buffers (staged) or the callers' own tensors (unstaged), since equal results would not tell.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from patch_cases import generate

import paradiff
from paradiff.errors import ParadiffError
from paradiff.runtime.comm import STAGE_HOST_VARIABLE, Communicator, HostStaging
from paradiff.runtime.distributed import BACKEND_VARIABLE, RankGroup, backend_for, destroy_groups
from paradiff.runtime.step_state import StepState
from paradiff.tiny import build_pipeline, prompt_inputs


class _Staged:
    """``PARADIFF_STAGE_HOST=1`` for the block (in this worker process)."""

    def __enter__(self):
        os.environ[STAGE_HOST_VARIABLE] = "1"

    def __exit__(self, *_):
        os.environ.pop(STAGE_HOST_VARIABLE, None)


#: The torch.distributed calls that take tensors to move.
TRANSPORT = ("isend", "irecv", "broadcast", "all_gather", "all_reduce")


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


class _TransportSpy:
    """Records, in this worker, each tensor handed to torch.distributed and each host buffer staging made.

    Equal results alone would also pass if transfers went direct; this tells which tensors the transport got.
    Messages of a ``batch_isend_irecv`` are seen as their ``P2POp`` is built (torch checks its ``op`` is the
    stock ``isend`` or ``irecv``, so the op is handed over unwrapped).
    """

    def __init__(self):
        self.handed: list[tuple[str, torch.Tensor]] = []
        self.hosts: list[torch.Tensor] = []  # kept alive, so that no other tensor takes one's id

    def __enter__(self) -> _TransportSpy:
        self.stock = {name: getattr(dist, name) for name in (*TRANSPORT, "P2POp")}
        self.stock_host = HostStaging._host
        stock, spy = self.stock, self

        def recording(name: str):
            def call(*args, **kwargs):
                for value in (*args, *kwargs.values()):  # a tensor, or all_gather's list of pieces
                    spy.handed += [(name, t) for t in (value if isinstance(value, list) else [value]) if _is_tensor(t)]
                return stock[name](*args, **kwargs)

            return call

        class P2POp(stock["P2POp"]):
            def __new__(cls, op, tensor, *args, **kwargs):
                return super().__new__(cls, spy.unwrapped(op), tensor, *args, **kwargs)

            def __init__(self, op, tensor, *args, **kwargs):
                spy.handed.append((spy.unwrapped(op).__name__, tensor))
                super().__init__(spy.unwrapped(op), tensor, *args, **kwargs)

        def host(staging, tensor):
            spy.hosts.append(spy.stock_host(staging, tensor))
            return spy.hosts[-1]

        self.wrappers = {name: recording(name) for name in TRANSPORT}
        for name, wrapper in self.wrappers.items():
            setattr(dist, name, wrapper)
        dist.P2POp, HostStaging._host = P2POp, host
        return self

    def unwrapped(self, op):
        return next((self.stock[name] for name, wrapper in self.wrappers.items() if wrapper is op), op)

    def __exit__(self, *_):
        for name, fn in self.stock.items():
            setattr(dist, name, fn)
        HostStaging._host = self.stock_host

    def through_host(self) -> dict[str, list[bool]]:
        """Per transport call, whether each tensor it got was a host buffer of the staging."""
        hosts, seen = {id(buffer) for buffer in self.hosts}, defaultdict(list)
        for name, tensor in self.handed:
            seen[name].append(id(tensor) in hosts)
        return dict(seen)


def _all_through_host(spy: _TransportSpy) -> bool:
    return bool(spy.handed) and all(all(flags) for flags in spy.through_host().values())


def _none_through_host(spy: _TransportSpy) -> bool:
    return bool(spy.handed) and not spy.hosts and not any(any(flags) for flags in spy.through_host().values())


def staged_exchanges(staged: bool) -> dict:
    """Each kind of exchange once; what the receiving tensors held before and after the wait, and which tensors
    the transport got."""
    rank = dist.get_rank()
    os.environ.pop(STAGE_HOST_VARIABLE, None)
    with _Staged() if staged else contextlib.nullcontext():
        comm = Communicator(RankGroup.world(timedelta(seconds=60)), StepState(warmup_steps=0))
    try:
        with _TransportSpy() as spy:
            seen = _exchanges(comm, rank)
    finally:
        destroy_groups(*comm.ranks.process_groups())
    return {**seen, "through_host": spy.through_host(), "host_buffers": len(spy.hosts)}


def _exchanges(comm: Communicator, rank: int) -> dict:
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


#: What each rank's exchanges hand to torch.distributed, tensors per call (rank 0 sends, rank 1 receives).
HANDED = [
    {"all_gather": 3, "isend": 2, "broadcast": 1, "all_reduce": 1, "irecv": 1},
    {"all_gather": 3, "irecv": 2, "broadcast": 1, "all_reduce": 1, "isend": 1},
]


def _check_exchanges(results: list[dict], staged: bool) -> None:
    """Every exchange gives its values, and every tensor the transport got is a host buffer (``staged``) or none."""
    zero, one = [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]
    for rank, seen in enumerate(results):
        through_host = seen["through_host"]
        assert {name: len(flags) for name, flags in through_host.items()} == HANDED[rank]
        assert all(flag is staged for flags in through_host.values() for flag in flags), through_host
        assert seen["staged"] is staged and (seen["host_buffers"] > 0) is staged
        assert seen["gather"] == zero + one
        assert seen["broadcast"] == one
        assert seen["reduced"] == [a + b for a, b in zip(zero, one, strict=True)]
        assert seen["from_neighbour"] == ([2.0, 3.0] if rank == 1 else [10.0, 11.0])  # the other's facing rows
    assert results[1]["received"] == zero


@pytest.mark.timeout(120)
def test_every_exchange_arrives_through_host_buffers(pool2):
    results = pool2.run(staged_exchanges, True)
    _check_exchanges(results, staged=True)
    for seen in results:
        assert seen["gather_before_wait"] == [-1.0] * 8, "a staged receive reached the tensor before the wait"


@pytest.mark.timeout(120)
def test_unstaged_exchanges_hand_the_callers_tensors_to_the_transport(pool2):
    _check_exchanges(pool2.run(staged_exchanges, False), staged=False)


def staged_against_unstaged(family: str, size: int, steps: int, **options) -> dict:
    """The image of ``parallelize(pipe, **options)`` without staging, then with every transfer staged."""
    pipe = build_pipeline(family)
    inputs = prompt_inputs(pipe, family)
    images, routes = [], []
    for staged in (False, True):
        os.environ.pop(STAGE_HOST_VARIABLE, None)
        if staged:
            os.environ[STAGE_HOST_VARIABLE] = "1"
        try:
            with _TransportSpy() as spy:
                pipe = paradiff.parallelize(pipe, **options)
                images.append(generate(pipe, inputs, size, steps))
            routes.append(_all_through_host(spy) if staged else _none_through_host(spy))
            stats = paradiff.comm_stats(pipe)
        finally:
            os.environ.pop(STAGE_HOST_VARIABLE, None)
            paradiff.unparallelize(pipe)
    return {
        "difference": float(np.abs(images[1] - images[0]).max()),
        "bytes": stats["bytes_per_step"],
        "direct_unstaged": routes[0],
        "through_host_staged": routes[1],
        "direct_when_staged": {name: flags.count(False) for name, flags in spy.through_host().items()},
    }


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
        assert result["direct_unstaged"]  # the transport got the strategy's own tensors, and no buffer was made
        assert result["through_host_staged"], result["direct_when_staged"]  # and staged, only host buffers
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
