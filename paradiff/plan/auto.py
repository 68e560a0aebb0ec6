"""``strategy="auto"``: the first ``pipe(...)`` call plans itself, then runs under the fastest predicted strategy.

The call's own arguments (its size, steps, frames, prompt) are what the plan traces and times, so nothing is
guessed: the capture calls stop at the second denoiser call, the generators given are put back as they
were, and the timing is a few denoiser calls on every rank. Rank 0's choice is broadcast, so every rank
installs the same strategy. ``fidelity="exact"`` picks among the strategies whose result equals one
device's (the CFG split, Ulysses, ring, or a displaced strategy whose warm-up covers every step);
``"displaced"`` among all.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compat import progress_bar_off
from ..errors import ParadiffError
from ..loading import default_height
from ..runtime.distributed import local_device
from .costs import Prediction, always_exact
from .job import Plan, PlanJob
from .on_ranks import plan_pipeline

FIDELITIES = ("exact", "displaced")


@dataclass(frozen=True)
class Choice:
    """What ``strategy="auto"`` picked and why (``paradiff.plan_of(pipe)``)."""

    prediction: Prediction
    plan: Plan
    fidelity: str
    #: Seconds the first call spent planning (tracing, timing, choosing) before it ran.
    planning_s: float = 0.0

    @property
    def reason(self) -> str:
        among = "the exact strategies" if self.fidelity == "exact" else "every strategy"
        p = self.prediction
        warmup = "" if always_exact(p.strategy) else f", warm-up {p.warmup_steps}"
        return (
            f"{p.label}{warmup}: {p.predicted_speedup:.2f}× predicted over one device, the fastest of {among} "
            f"that run this pipeline at {self.plan.pixels} on {self.plan.nproc} ranks (planning took "
            f"{self.planning_s:.2g} s of the first call)"
        )


def check_fidelity(fidelity: str) -> None:
    if fidelity not in FIDELITIES:
        raise ParadiffError(f"fidelity must be 'exact' or 'displaced', got {fidelity!r}")


@contextlib.contextmanager
def untouched_generators(pipe, kwargs: dict):
    """The generators in ``kwargs`` and the progress bar as they were, whatever runs inside (bar off meanwhile)."""

    generators = kwargs.get("generator")
    generators = generators if isinstance(generators, list) else [generators]
    states = [(g, g.get_state()) for g in generators if isinstance(g, torch.Generator)]
    try:
        with progress_bar_off(pipe):
            yield
    finally:
        for generator, state in states:
            generator.set_state(state)


def choose(pipe, stock_call, args: tuple, kwargs: dict, fidelity: str, warmup_steps: int) -> Choice:
    """Plan this call on every rank and pick the fastest predicted setting (a collective)."""

    start = time.perf_counter()
    parameters = inspect.signature(stock_call).parameters
    size = kwargs.get("height") or default_height(pipe)
    if size is None:
        raise ParadiffError(f"strategy='auto' cannot tell what size {type(pipe).__name__} draws at; pass height=")
    steps = kwargs.get("num_inference_steps") or parameters["num_inference_steps"].default
    width = kwargs.get("width") or size

    def call(height: int, call_steps: int, output_type: str):
        sized = {"height": height, "width": width} if "height" in parameters else {}
        settings = {**sized, "num_inference_steps": call_steps, "output_type": output_type}
        return stock_call(pipe, *args, **{**kwargs, **settings})

    job = PlanJob(
        model=type(pipe).__name__, nproc=dist.get_world_size(), steps=steps, warmups=(warmup_steps,), width=width
    )
    with untouched_generators(pipe, kwargs):
        plan = plan_pipeline(pipe, call, size, job, local_device())
    decided = None
    if plan is not None:  # rank 0
        best = plan.best(exact=fidelity == "exact")
        unfit = f"; {plan.unfit()}" if plan.unfit() else ""
        decided = (best, plan) if best is not None else f"no strategy runs {type(pipe).__name__} ({fidelity}){unfit}"
    shared = [decided]
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], str):
        raise ParadiffError(f"strategy='auto' found {shared[0]}")
    best, plan = shared[0]
    return Choice(best, plan, fidelity, time.perf_counter() - start)
