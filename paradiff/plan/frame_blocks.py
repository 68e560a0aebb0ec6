"""A diffusion-forcing pipeline's loop as ``dualparal`` runs it: the block schedule, and one frame block's cost.

The pipeline (SkyReels-V2's diffusion forcing) schedules its window's frame blocks itself: at every iteration
of its loop some blocks move one noise level down (they are in flight), the older ones have finished and the
newer ones wait. The stock loop calls the denoiser on every frame of the window at every iteration;
``dualparal`` runs each call as passes of one frame block through every stage: one pass per block in flight
and, fresh (during warm-up), one more for each block that has just finished, so that the oldest block in
flight reads its final keys and values.

One pass's cost is traced on the meta device over a block and the context frames before it, then scaled to
the block's own frames by ``B / (B + c)``: exact for every per-token layer, and for the self-attention too,
whose ``B`` frames of queries see ``B + c`` frames of keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import family_of
from ..models.base import bind_inputs
from .workload import Workload, capture_inputs, meta_model, on_meta, trace


@dataclass(frozen=True)
class BlockLoop:
    """The first window's schedule and one block pass's workload."""

    #: The denoiser over one frame block and its context frames (``fraction`` of it is one pass).
    block: Workload
    fraction: float
    #: Per iteration of the loop: the frame blocks in flight, and the blocks that finished since the
    #: previous iteration (behind the oldest block in flight).
    in_flight: tuple[int, ...]
    finished: tuple[int, ...]
    #: Frame blocks in the window.
    blocks: int

    @property
    def iterations(self) -> int:
        return len(self.in_flight)


def schedule_counts(update_mask: torch.Tensor, block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(in flight, just finished)`` per iteration, from the pipeline's ``(iterations, frames)`` update mask."""
    moving = update_mask[:, ::block].bool()
    in_flight = tuple(int(row.sum()) for row in moving)
    oldest = [int(row.nonzero()[0]) if row.any() else moving.shape[1] for row in moving]
    finished = tuple(max(now - before, 0) for before, now in zip([oldest[0], *oldest], oldest, strict=False))
    return in_flight, finished


def block_loop(pipe, call: Callable[[], object], dtype: torch.dtype, context: int | None = None) -> BlockLoop | None:
    """The loop ``call()`` (a call of the diffusion-forcing ``pipe``) runs; None if it schedules no frame blocks.

    ``context``: the frames of the previous block a block attends to (``dualparal_context``; None: a whole block).
    """
    from ..layers.stages import stage_blocks
    from ..pipeline import find_denoiser
    from ..strategies.dualparal import block_schedules, frame_blocks_of

    denoiser = find_denoiser(pipe)
    family = family_of(denoiser, any_model=True)
    schedules = []
    model = meta_model(type(denoiser), dict(denoiser.config), dtype)
    with block_schedules(pipe, lambda arguments, matrices: schedules.append((arguments, matrices))):
        captured = capture_inputs(denoiser, family, model, dtype, call)
    if not schedules or (schedules[0][0]["causal_block_size"] or 1) <= 1:
        return None
    arguments, (_, _, update_mask, _) = schedules[0]
    block = arguments["causal_block_size"]
    inputs = dict(bind_inputs(denoiser, captured.args, captured.kwargs).arguments)
    frames = inputs[family.latent_arg].shape[2]
    traced = min(block + (context or block), frames)
    inputs[family.latent_arg] = inputs[family.latent_arg][:, :, :traced]
    timestep = inputs[family.timestep_arg]
    if torch.is_tensor(timestep) and timestep.ndim > 1:  # one level per frame
        inputs[family.timestep_arg] = timestep[:, :traced]
    stack = stage_blocks(model, frame_blocks_of(family).stack)
    workload = trace(model, (), on_meta(inputs, dtype), 1, captured.calls_per_step, units=stack)
    in_flight, finished = schedule_counts(update_mask, block)
    return BlockLoop(workload, min(block / traced, 1.0), in_flight, finished, frames // block)
