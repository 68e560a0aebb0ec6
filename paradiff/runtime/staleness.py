"""The staleness guard's decision: does this displaced step refresh (run in sync, like a warm-up step)?

A displaced step reuses activations computed at an earlier step; they are as wrong as the model's features
moved since. The denoiser's input latent is a poor witness of that: under the schedules the zoo uses it moves
by about the same share at every step, while the features move most in the first steps. The prediction moves
with the features, and the last two steps' predictions are known before the next step starts. So each rank
measures how far its last prediction moved from the one before (``moved_db``: 20·log10(|p|/|p − p_prev|), the
smaller the further), the ranks agree on the smallest (one all-reduce of one number), and a step whose figure
is below the threshold refreshes. A step before two predictions are known refreshes too: nothing to measure.

The threshold is not the user's: it is calibrated so that the call it calibrates on holds a PSNR floor
(``paradiff.fidelity_floor``). ``threshold_db=None`` refreshes every step (the calibration's reference run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

#: ``moved_db`` of a step before two predictions are known: it refreshes whatever the threshold.
UNMEASURED = -math.inf


@dataclass
class GuardCounters:
    """What the guard decided in one ``pipe(...)`` call: its threshold, every step's agreed figure, the refreshes."""

    threshold_db: float | None
    moved_db: dict[int, float] = field(default_factory=dict)
    refreshed_steps: list[int] = field(default_factory=list)
    #: Runs of the call and seconds that calibrated the threshold before it ran (0: it was known).
    calibration_runs: int = 0
    calibration_s: float = 0.0


def moved_db(previous: torch.Tensor, latest: torch.Tensor) -> float:
    """How far ``latest`` moved from ``previous``, in dB of its own size (inf: not at all)."""
    change = float((latest.float() - previous.float()).norm())
    if change == 0.0:
        return math.inf
    return 20 * math.log10(max(float(latest.float().norm()), 1e-30) / change)


class StalenessGuard:
    """One strategy group's guard: the last two predictions this rank saw, and the steps it decided."""

    def __init__(self, comm, threshold_db: float | None = None):
        self.comm = comm
        self.threshold_db = threshold_db
        #: ``(runs, seconds)`` of the calibration that chose the threshold of the next call, if it just ran.
        self.calibrated: tuple[int, float] | None = None
        self.run = -1
        self.reset()

    def reset(self) -> None:
        self.predictions: list[torch.Tensor] = []
        self.observed: set[int] = set()
        self.counters = GuardCounters(self.threshold_db)
        if self.calibrated is not None:
            self.counters.calibration_runs, self.counters.calibration_s = self.calibrated
            self.calibrated = None
        self.comm.stats.guard = self.counters

    def begin(self) -> None:
        """Forget the last call's predictions when a new ``pipe(...)`` call has begun (its step state says so)."""
        if self.run != self.comm.state.run:
            self.run = self.comm.state.run
            self.reset()

    def decide(self, step: int) -> bool:
        """Whether ``step`` refreshes, the same on every rank of the group (collective: call it on every rank)."""
        counters = self.counters
        if step in counters.moved_db:
            return step in counters.refreshed_steps
        local = moved_db(*self.predictions) if len(self.predictions) == 2 else UNMEASURED
        agreed = self._smallest(local)
        counters.moved_db[step] = agreed
        refresh = self.threshold_db is None or agreed == UNMEASURED or agreed < self.threshold_db
        if refresh:
            counters.refreshed_steps.append(step)
        return refresh

    def observe(self, step: int, prediction: torch.Tensor) -> None:
        """Keep the first prediction of ``step`` (later calls of the step, two-call guidance's, are not kept)."""
        if step in self.observed:
            return
        self.observed.add(step)
        self.predictions = [*self.predictions[-1:], prediction.detach().clone()]

    def _smallest(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.comm.device)
        return float(self.comm.all_reduce(tensor, dist.ReduceOp.MIN)[0])
