"""The single source of truth for "which denoising step is this" on one wrapped denoiser.

The denoiser is not told the step index, and pipelines may call it more than once per step (true CFG
in Flux, unbatched guidance) inside ``model.cache_context(name)`` blocks. A step is therefore derived
per call context from timestep changes: a call whose timestep differs from the previous call's in the
same context starts a new step; a second call at the same timestep is a separate *call slot* of that
step and gets buffers of its own. Every rank sees the same contexts, timesteps and shapes, so every
rank takes the same warm-up/displaced decision at the same time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .staleness import StalenessGuard


@dataclass
class _ContextCursor:
    step: int = -1
    call_in_step: int = 0
    last_timestep: tuple[float, ...] | None = None


@dataclass
class RowPartition:
    """How the image's grid (latent rows × cols, or token rows × cols) is cut into equal row bands, and which samples
    of the call's ``batch`` a pass holds (``samples``; None: all of them)."""

    rows: int
    cols: int
    parts: int
    rank: int
    samples: slice | None = None
    batch: int = 0

    @property
    def band_rows(self) -> int:
        return self.rows // self.parts

    @property
    def row_start(self) -> int:
        return self.rank * self.band_rows

    @property
    def band_tokens(self) -> int:
        return self.band_rows * self.cols

    def cols_for_band_tokens(self, band_tokens: int) -> int:
        """Columns of a down-sampled level whose band holds ``band_tokens`` tokens (same aspect ratio)."""
        factor_sq = self.band_tokens / band_tokens
        factor = round(factor_sq**0.5)
        if factor * factor != factor_sq or self.cols % factor:
            raise RuntimeError(f"a band of {band_tokens} tokens does not match the {self.rows}x{self.cols} grid")
        return self.cols // factor


@dataclass
class StepState:
    """Step counting per call context, warm-up decisions, and the per-run exchange buffers."""

    warmup_steps: int
    #: The staleness guard that may refresh displaced steps (``fidelity_floor_db``, ``runtime.staleness``); None
    #: without one. With one no call may start before the one before it ended (``pipefusion`` drains).
    guard: StalenessGuard | None = None
    run: int = 0
    context: str = "default"
    step: int = -1
    call_in_step: int = 0
    partition: RowPartition | None = None
    #: How the CFG split runs the call in progress (its hook sets it; None without one): "halves" (each group of
    #: the split runs half of the call's batch), "first" or "second" (the call is the first or the second of a
    #: step's two calls of two-call guidance, which the groups run one each).
    cfg_call: str | None = None
    buffers: dict = field(default_factory=dict)
    #: Displaced steps the staleness guard refreshes (``runtime.staleness``): they run in sync, like warm-up.
    refreshed: set[int] = field(default_factory=set)
    _cursors: dict[str, _ContextCursor] = field(default_factory=dict)

    def begin_run(self) -> None:
        """Forget every stale activation: called at the start of each ``pipe(...)`` call."""
        self.drain()
        self.run += 1
        self.buffers.clear()
        self.refreshed.clear()
        self._cursors.clear()
        self.step, self.call_in_step, self.context, self.cfg_call = -1, 0, "default", None

    def drain(self) -> None:
        """Wait for collectives still in flight so none leaks into the next run."""
        for exchange in self.buffers.values():
            if hasattr(exchange, "drain"):
                exchange.drain()

    def enter_call(self, context: str | None, timestep) -> None:
        self.context = context or "default"
        self.step, self.call_in_step = self.peek(context, timestep)
        cursor = self._cursors.setdefault(self.context, _ContextCursor())
        cursor.step, cursor.call_in_step, cursor.last_timestep = self.step, self.call_in_step, timestep_key(timestep)

    def peek(self, context: str | None, timestep) -> tuple[int, int]:
        """``(step, call slot)`` a call in ``context`` at ``timestep`` would get now (nothing is counted)."""
        cursor = self._cursors.get(context or "default", _ContextCursor())
        if cursor.last_timestep is not None and timestep_key(timestep) == cursor.last_timestep:
            return cursor.step, cursor.call_in_step + 1
        return cursor.step + 1, 0

    @contextmanager
    def as_call(self, context: str | None, step: int, call_in_step: int) -> Iterator[None]:
        """Inside the block, buffers and counters are those of the call ``(context, step, call_in_step)``: work done
        ahead for a call the pipeline has not made yet (``pipefusion``'s flowing pipeline)."""
        saved = self.context, self.step, self.call_in_step, self.partition
        self.context, self.step, self.call_in_step = context or "default", step, call_in_step
        try:
            yield
        finally:
            self.context, self.step, self.call_in_step, self.partition = saved

    @property
    def synchronous(self) -> bool:
        """The first step and ``warmup_steps`` more exchange fresh data (exact), and so do the steps the staleness
        guard refreshes; the other steps are displaced."""
        return self.step <= self.warmup_steps or self.step in self.refreshed

    def displaced_index(self) -> int:
        """How many displaced steps came between the last step in sync and this one (−1: this one is in sync)."""
        return -1 if self.synchronous else displaced_since_sync(self.step, self.warmup_steps, self.refreshed)

    def exchange(self, name: str, factory):
        """The exchange buffers of layer ``name`` for the current call context and call slot."""
        return self.per_run((name, self.context, self.call_in_step), factory)

    def per_run(self, key, factory):
        """The object kept as ``key`` for this ``pipe(...)`` call (made by ``factory`` on first use; drained at its
        end if it has a ``drain`` method)."""
        if key not in self.buffers:
            self.buffers[key] = factory()
        return self.buffers[key]


def displaced_since_sync(step: int, warmup_steps: int, refreshed: set[int]) -> int:
    """Displaced steps between the last step in sync before ``step`` (the warm-up's last, or a refreshed one) and
    ``step``, for a displaced ``step``."""
    return step - max([warmup_steps, *(done for done in refreshed if done < step)]) - 1


def timestep_key(timestep) -> tuple[float, ...]:
    """A call's timestep as a comparable key: its distinct values, sorted. A per-frame timestep (diffusion forcing)
    keeps its first frame at 0 once that frame is done, while later frames still move, so no single value tells
    steps apart; distinct values keep the key one number for a batch of samples at one level, whatever its size."""
    if isinstance(timestep, torch.Tensor):
        return tuple(torch.unique(timestep.detach()).cpu().tolist())
    return (float(timestep),)
