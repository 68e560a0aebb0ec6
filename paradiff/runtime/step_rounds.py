"""Rounds of step parallelism (``parastep``): who runs the denoiser at which step, and what travels.

Steps are counted by the pipeline's own calls to its scheduler's ``step`` (one per denoising step,
whatever the number of denoiser calls in it), from 0 at each ``pipe(...)`` call. Every rank makes the
same calls in the same order, so every rank counts the same steps and takes the same decisions.

* Steps 0..W (the first step and W warm-up steps) run on every rank alike: exact. So does a step the
  staleness guard refreshes (``fidelity_floor_db``); it decides only where a round would start, when every
  rank holds the same latent, from how far each rank's last two predictions moved.
* Later steps go in rounds of N (the group's size), counted from the last exact step; all ranks start a
  round with the same latent and scheduler state. Rank k runs the denoiser at position k of the round
  only, on its own copy of the latent, which it advanced through positions 0..k-1 with its last noise
  prediction (scheduler steps alone); it reuses that prediction at every other position. Rank k ≥ 1 sends
  its fresh prediction (what the pipeline hands to ``scheduler.step``, after the CFG combine) to rank 0,
  which applies it at position k instead of its own reused one. At the round's last step rank 0 broadcasts
  its latent, and every rank continues from it.

Multistep schedulers (DPM-Solver, UniPC, PNDM) keep a history of predictions in the scheduler
instance. Within a round the other ranks' histories hold their speculative steps, so the broadcast
also carries every tensor the scheduler stored during the round (found by identity: tensors reachable
from the instance's attributes that were not there at the round's start). After it, every rank's
scheduler state equals rank 0's. Single-step schedulers (DDIM, Euler, flow matching) store none, so a
round moves exactly N-1 predictions to rank 0 and one latent broadcast to the N-1 other ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ParadiffError
from .comm import Communicator, tensor_bytes
from .step_state import displaced_since_sync

#: A rank's fresh noise prediction sent to rank 0.
PREDICTION = "prediction"
#: Rank 0's latent broadcast at the end of a round.
LATENT = "latent"
#: The scheduler's history tensors stored during a round, broadcast with the latent (multistep schedulers).
SCHEDULER_STATE = "scheduler_state"


@dataclass(frozen=True)
class RoundPlan:
    """Steps 0..``warmup_steps`` and the ``refreshed`` ones on every rank, the others in rounds of ``ranks`` steps
    from the last of those, position k computed by rank k."""

    warmup_steps: int
    ranks: int
    refreshed: set[int] = field(default_factory=set)

    def position(self, step: int) -> int | None:
        """The step's position in its round (the rank that runs the denoiser for it); None for an exact step."""
        if step <= self.warmup_steps or step in self.refreshed:
            return None
        return displaced_since_sync(step, self.warmup_steps, self.refreshed) % self.ranks


class StepRounds:
    """One ``pipe(...)`` call on this rank: the step counter, the cached denoiser outputs, the open round."""

    def __init__(self, comm: Communicator, scheduler, loop_length: Callable[[], Any]):
        self.comm, self.scheduler, self.loop_length = comm, scheduler, loop_length
        self.plan = RoundPlan(comm.state.warmup_steps, comm.size)
        #: Scheduler steps done in this call: the index of the step the loop is in.
        self.step = 0
        #: This rank's last output of each call slot (call context, index in the step), for reuse.
        self.cache: dict[tuple[str | None, int], Any] = {}
        self.total: int | None = None
        self._calls: dict[str | None, int] = {}
        self._round: _Round | None = None

    # The denoiser's side.

    def slot(self, context: str | None) -> tuple[str | None, int]:
        """The call slot of a denoiser call: its cache context and its index among this step's calls in it."""
        index = self._calls.get(context, 0)
        self._calls[context] = index + 1
        return context, index

    def runs_model(self) -> bool:
        """Whether this rank computes the current step's prediction (warm-up, or its position in the round)."""
        position = self.plan.position(self.step)
        return position is None or position == self.comm.rank

    # The scheduler's side.

    def scheduler_step(self, stock_step: Callable, signature: inspect.Signature, *args, **kwargs):
        """Stands in for ``scheduler.step`` during the call: applies the agreed prediction, ends rounds."""
        step, position = self.step, self.plan.position(self.step)
        self.comm.record(PREDICTION, exchanges=0, step=step)  # every step has a row, exchange or not
        if position is None:
            output = stock_step(*args, **kwargs)
        else:
            bound = signature.bind(*args, **kwargs)
            if position == 0:
                self._round = self._open_round(bound.arguments["model_output"], bound.arguments.get("timestep"))
            output = self._round.step(stock_step, bound, position)
            if self._round.closed:
                self._round = None
        self.step += 1
        self._calls.clear()
        self._maybe_refresh()
        return output

    def _maybe_refresh(self) -> None:
        """Where the next step would start a round, ask the staleness guard whether it runs on every rank instead
        (every rank holds the same latent here)."""
        guard, step = self.comm.state.guard, self.step
        total = self.total or self.loop_length()
        if guard is None or step <= self.plan.warmup_steps or (total is not None and step >= total):
            return
        if self.plan.position(step) == 0 and guard.decide(step):
            self.plan.refreshed.add(step)

    def finish(self) -> None:
        """End of the call: every round must have closed, or the ranks would hold different latents."""
        if self._round is not None:
            first, last = self._round.start, self._round.start + self._round.length - 1
            raise ParadiffError(
                f"the denoising loop ended after {self.step} steps, inside the parastep round of steps {first} to "
                f"{last}; the ranks now hold different latents. parastep needs the loop to run to its last step "
                "(no interrupt, no denoising_end)"
            )

    def _open_round(self, like: torch.Tensor, timestep) -> _Round:
        if self.total is None:
            self.total = self._loop_length(timestep)  # the same on every rank: their calls agree
        length = min(self.comm.size, self.total - self.step)
        if length < 1:
            raise ParadiffError(
                f"step {self.step} is past the {self.total} steps parastep expected; the pipeline's loop ran longer "
                "than its scheduler's timesteps"
            )
        return _Round(self.comm, self.scheduler, self.step, length, like)

    def _loop_length(self, timestep) -> int:
        """The loop length the pipeline recorded (``paradiff.compat.loop_length``), else from the scheduler."""
        length = self.loop_length()
        if length is not None:
            return length
        scheduler = self.scheduler
        timesteps = scheduler.timesteps
        index = getattr(scheduler, "step_index", None)
        if index is None and timestep is not None:  # schedulers without a step index (DDIM): find the timestep
            matches = (timesteps == torch.as_tensor(timestep).to(timesteps.device)).nonzero()
            index = int(matches[0, 0]) if len(matches) else None
        if index is None:
            raise ParadiffError(
                f"parastep cannot tell how many steps the loop has: the pipeline records no loop length and "
                f"{type(scheduler).__name__} has no step_index nor this step's timestep {timestep!r}"
            )
        return self.step + len(timesteps) - index


class _Round:
    """The steps ``start .. start + length - 1``: predictions in flight to rank 0, then rank 0's broadcast."""

    def __init__(self, comm: Communicator, scheduler, start: int, length: int, like: torch.Tensor):
        self.comm, self.scheduler, self.start, self.length = comm, scheduler, start, length
        self.closed = False
        #: The scheduler's tensors at the round's start (kept, so that their ids stay unique until the end).
        self.known = scheduler_tensors(scheduler)
        self.sends: list = []
        self.receives: dict[int, tuple[torch.Tensor, Any]] = {}
        #: Tags of this round's predictions: a receive a failed call left posted matches nothing later.
        self.tags = comm.tags(length)
        if comm.rank == 0:  # posted now, so each prediction lands as soon as its rank has it
            for position in range(1, length):
                buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
                self.receives[position] = (buffer, comm.receive(buffer, position, self.tags[position]))

    def step(self, stock_step: Callable, bound: inspect.BoundArguments, position: int):
        comm, step = self.comm, self.start + position
        if comm.rank == 0 and position > 0:
            prediction, work = self.receives.pop(position)
            comm.record(PREDICTION, wait_s=comm.wait([work]), exchanges=0, step=step)
            bound.arguments["model_output"] = prediction
        elif position > 0 and comm.rank == position:
            prediction = bound.arguments["model_output"].contiguous()
            work, nbytes = comm.send(prediction, 0, self.tags[position])
            self.sends.append((work, prediction))
            comm.record(PREDICTION, nbytes, step=step)
        output = stock_step(*bound.args, **bound.kwargs)
        if position == self.length - 1:
            self._close(step, output)
        return output

    def _close(self, step: int, output) -> None:
        """Rank 0's latent and the scheduler tensors stored during the round, on every rank (in place)."""
        comm = self.comm
        wait_s = comm.wait([work for work, _ in self.sends])
        latent = output[0]
        known = {id(t) for t in self.known}
        state = [t for t in scheduler_tensors(self.scheduler) if id(t) not in known]
        wait_s += broadcast_in_place([latent, *state], comm, latent.device)
        others = comm.size - 1 if comm.rank == 0 else 0
        comm.record(LATENT, tensor_bytes(latent) * others, wait_s, step=step)
        comm.record(SCHEDULER_STATE, sum(tensor_bytes(t) for t in state) * others, exchanges=0, step=step)
        self.known, self.sends, self.closed = [], [], True


def scheduler_tensors(scheduler) -> list[torch.Tensor]:
    """Every tensor held by the scheduler's attributes (directly or in lists, tuples and dicts), in order."""
    found: list[torch.Tensor] = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    for value in vars(scheduler).values():
        walk(value)
    return found


def broadcast_in_place(tensors: list[torch.Tensor], comm: Communicator, device: torch.device) -> float:
    """Overwrite ``tensors`` with rank 0's, one broadcast per dtype; returns the seconds spent blocked."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    wait_s = 0.0
    for dtype, group in by_dtype.items():
        if comm.rank == 0:
            flat = torch.cat([t.reshape(-1).to(device) for t in group])
        else:
            flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
        wait_s += comm.wait([comm.broadcast(flat, 0)[0]])
        if comm.rank != 0:
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset : offset + tensor.numel()].view(tensor.shape))
                offset += tensor.numel()
    return wait_s
