"""Cutting a DiT's blocks into contiguous pipeline stages of about equal measured cost.

Blocks of one kind (same class, same parameter shapes) cost the same, so one block of each kind is
timed, on random tokens of a fixed size, before the blocks are freed. The kinds differ within a model
only in a few places (Flux's double- and single-stream blocks, SD3's last block without a text MLP,
SD3.5's blocks with a second attention), and a parameter count misjudges them: a Flux double-stream
block has 2.4× the parameters of a single-stream one, but each token meets about the same number of
them. Ranks time on their own and agree on the mean, so that all of them take the same cut; the cut
changes only the speed, never the result (every stage runs the patches in the same order).

A family that cannot build a block's inputs on its own (no ``block_inputs``) is cut by parameter
count instead: exact for stacks of one kind of block, a proxy otherwise.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import nn

from ..models import DenoiserFamily
from ..runtime.comm import Communicator

#: Image and text tokens of the timing pass: small enough to cost milliseconds, large enough that the
#: matrix products dominate, as they do at real sizes.
TIMING_TOKENS = (256, 64)
TIMING_REPEATS = 3


def block_kind(block: nn.Module) -> tuple:
    return (type(block).__qualname__, tuple((name, tuple(p.shape)) for name, p in block.named_parameters()))


def measured_costs(
    family: DenoiserFamily, model: nn.Module, blocks: list[nn.Module], comm: Communicator
) -> list[float]:
    """Seconds per block of one forward on the timing tokens, agreed (averaged) over ``comm``'s ranks."""
    if type(family).block_inputs is DenoiserFamily.block_inputs:
        return [float(sum(p.numel() for p in block.parameters())) for block in blocks]
    kinds = list(dict.fromkeys(block_kind(block) for block in blocks))
    mean = mean_over_ranks([_time_block(family, model, blocks, kind) for kind in kinds], comm)
    return [mean[kinds.index(block_kind(block))] for block in blocks]


def mean_over_ranks(seconds: list[float], comm: Communicator) -> list[float]:
    """Each rank's timings averaged over ``comm``'s ranks, so that every rank derives the same cut from them."""
    total = comm.all_reduce(torch.tensor(seconds, dtype=torch.float64).to(comm.device))
    return (total.cpu() / comm.size).tolist()


def _time_block(family: DenoiserFamily, model: nn.Module, blocks: list[nn.Module], kind: tuple) -> float:
    block = next(b for b in blocks if block_kind(b) == kind)
    inputs = family.block_inputs(model, *TIMING_TOKENS)
    best = float("inf")
    with torch.no_grad():
        for _ in range(TIMING_REPEATS):
            _synchronize(model)
            start = time.perf_counter()
            block(**inputs)
            _synchronize(model)
            best = min(best, time.perf_counter() - start)
    return best


def _synchronize(model: nn.Module) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def cut_by_bytes(blocks: list[nn.Module], stages: int) -> tuple[int, ...]:
    """Blocks per stage of the contiguous cut whose stages hold about equal parameter bytes (what each rank keeps)."""
    return balanced_cut(
        [float(sum(p.numel() * p.element_size() for p in block.parameters())) for block in blocks], stages
    )


def balanced_cut(costs: list[float], stages: int) -> tuple[int, ...]:
    """Blocks per stage of the contiguous cut of ``costs`` into ``stages`` parts with the smallest largest part.

    Dynamic programming over (stages used, blocks covered); among equally good cuts the earliest
    boundaries win, so every rank computes the same one.
    """
    count = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    # best[k][i]: the smallest largest part cutting the first i blocks into k parts; start[k][i]: its last part's start
    best = [[float("inf")] * (count + 1) for _ in range(stages + 1)]
    start = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                largest = max(best[k - 1][j], prefix[i] - prefix[j])
                if largest < best[k][i] - 1e-12 * prefix[count]:
                    best[k][i], start[k][i] = largest, j
    sizes, end = [], count
    for k in range(stages, 0, -1):
        sizes.append(end - start[k][end])
        end = start[k][end]
    return tuple(reversed(sizes))
