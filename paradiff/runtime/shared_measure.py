"""A per-step measure whose parts lie on several ranks, summed so that every rank takes the same decision.

A step cache decides at every step from a measure of the denoiser's activations (FirstBlockCache: how much
its first block's residual changed since the last computed step). When a call's tokens (``patch``,
``ulysses``, ``ring``) or its batch (the CFG split) lie in parts on several ranks, each rank sees only its
part, and ranks that decide from their own parts take different paths: one runs the later blocks and their
collectives while another skips them (a gloo abort, or a hang until the timeout), or they skip at different
steps (a silently different image). So a measure is written as sums (a numerator and a denominator), each
rank's sums are all-gathered over every group that holds part of the call and added in rank order, and
every rank gets the same float64 values bit for bit: one collective of a few bytes per group and decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .comm import MEASURE, Communicator


class SharedMeasure:
    """Sums over the ranks that hold part of the call in progress; ``groups()`` names their groups, outermost
    last (every rank of the world calls them in the same order)."""

    def __init__(self, groups: Callable[[], Sequence[Communicator]]):
        self.groups = groups

    def shared(self) -> bool:
        """Whether the call in progress lies in parts on several ranks (else this rank's sums are the whole)."""
        return bool(self.groups())

    def total(self, sums: torch.Tensor) -> torch.Tensor:
        """This rank's partial ``sums`` (a 1-D tensor) added over every rank holding part of the call: float64 on
        the CPU, the same on every rank."""
        total = sums.detach().to(torch.float64).reshape(-1).cpu()
        for comm in self.groups():
            mine = total.to(comm.device)
            pieces = [torch.empty_like(mine) for _ in range(comm.size)]
            transfer, nbytes = comm.all_gather(pieces, mine)
            comm.record(MEASURE, nbytes, comm.wait([transfer]))
            total = torch.zeros_like(total)
            for piece in pieces:  # in rank order, so that every rank adds the same numbers the same way
                total += piece.cpu()
        return total
