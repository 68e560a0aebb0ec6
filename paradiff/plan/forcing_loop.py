"""A diffusion-forcing pipeline's loop as ``dualparal`` runs it: the block schedule, and one frame block's cost.

The pipeline (SkyReels-V2's diffusion forcing) schedules its window's frame blocks itself: at every iteration
of its loop some blocks move one noise level down (they are in flight), the older ones have finished and the
newer ones wait. The stock loop calls the denoiser on every frame of the window at every iteration;
``dualparal`` runs each call as passes of one frame block through every stage: one pass per block in flight
and, fresh (during warm-up), one more for each block that has just finished, so that the oldest block in
flight reads its final keys and values.

A video longer than the pipeline's ``base_num_frames`` runs in windows, one schedule each; one device's
call over a window costs its frames, and their square for the self-attention (:func:`window_cost`).

One pass's cost is traced on the meta device over a block and the context frames before it, then scaled to
the block's own frames by ``B / (B + c)``: exact for every per-token layer, and for the self-attention too,
whose ``B`` frames of queries see ``B + c`` frames of keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import family_of, find_denoiser
from ..models.base import bind_inputs
from ..stages.blocks import stage_blocks
from ..strategies.dualparal import block_schedules
from .workload import Capture, Workload, denoiser_skipped, meta_model, on_meta, trace


@dataclass(frozen=True)
class BlockLoop:
    """Every window's schedule, one after the other, and one block pass's workload."""

    #: The denoiser over one frame block and its context frames (``fraction`` of it is one pass).
    block: Workload
    fraction: float
    #: Per iteration of the loop: the frame blocks in flight, and the blocks behind the oldest of them that it
    #: has not run since they finished (a fresh call runs each once more: those of the previous iteration,
    #: or at a window's first iteration, every block the window starts with finished).
    in_flight: tuple[int, ...]
    finished: tuple[int, ...]
    #: Per iteration: its place in its window (each window starts fresh, as ``dualparal`` reads each schedule
    #: anew), and one device's cost relative to the first window's call (a shorter last window costs less).
    position: tuple[int, ...]
    scale: tuple[float, ...]
    #: The most frame blocks in one window.
    blocks: int

    @property
    def iterations(self) -> int:
        return len(self.in_flight)


def schedule_counts(update_mask: torch.Tensor, block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(in flight, finished behind them)`` per iteration, from one window's ``(iterations, frames)`` update mask."""
    moving = update_mask[:, ::block].bool()
    in_flight = tuple(int(row.sum()) for row in moving)
    oldest = [int(row.nonzero()[0]) if row.any() else moving.shape[1] for row in moving]
    finished = tuple(now - before for before, now in zip([0, *oldest], oldest, strict=False))
    return in_flight, finished


def window_cost(frames: int, measured: tuple[tuple[int, float], ...]) -> float:
    """One device's FLOPs of a call over ``frames`` latent frames, from two traced calls ``(frames, FLOPs)``: a
    per-frame part and a part that grows with the square of the frames (the self-attention)."""
    (f1, c1), (f2, c2) = measured
    if f1 == f2:
        return c1 * frames / f1
    quadratic = (c2 / f2 - c1 / f1) / (f2 - f1)
    return (c1 / f1 - quadratic * f1) * frames + quadratic * frames**2


def block_loop(
    pipe, call: Callable[[], object], dtype: torch.dtype, window: tuple[Workload, Capture], context: int | None = None
) -> BlockLoop | None:
    """The loop ``call()`` (a call of the diffusion-forcing ``pipe``) runs; None if it schedules no frame blocks.

    The call runs with the denoiser answering zeros (:func:`denoiser_skipped`), so that every window's schedule is
    made. ``window``: the first window's call as :func:`pipeline_workload` traced it. ``context``: the frames of
    the previous block a block attends to (``dualparal_context``; None: a whole block).
    """

    denoiser = find_denoiser(pipe)
    family = family_of(denoiser, any_model=True)
    model = meta_model(type(denoiser), dict(denoiser.config), dtype)
    window_call, captured = window
    schedules = []
    recorded = block_schedules(pipe, lambda arguments, matrices: schedules.append((arguments, matrices)))
    with recorded, denoiser_skipped(pipe, dtype):
        call()
    if not schedules or (schedules[0][0]["causal_block_size"] or 1) <= 1:
        return None
    block = schedules[0][0]["causal_block_size"]
    inputs = dict(bind_inputs(denoiser, captured.args, captured.kwargs).arguments)
    frames = inputs[family.latent_arg].shape[2]
    traced = min(block + (context or block), frames)
    inputs[family.latent_arg] = inputs[family.latent_arg][:, :, :traced]
    timestep = inputs[family.timestep_arg]
    if torch.is_tensor(timestep) and timestep.ndim > 1:  # one level per frame
        inputs[family.timestep_arg] = timestep[:, :traced]
    stack = stage_blocks(model, family.frame_blocks.stack)
    workload = trace(model, (), on_meta(inputs, dtype), 1, captured.calls_per_step, units=stack)
    measured = ((frames, window_call.flops), (traced, workload.flops))
    in_flight, finished, position, scale = [], [], [], []
    for arguments, (_, _, update_mask, _) in schedules:
        moving, behind = schedule_counts(update_mask, block)
        in_flight += moving
        finished += behind
        position += range(len(moving))
        scale += [window_cost(arguments["num_latent_frames"], measured) / window_call.flops] * len(moving)
    most = max(arguments["num_latent_frames"] for arguments, _ in schedules) // block
    return BlockLoop(workload, block / traced, tuple(in_flight), tuple(finished), tuple(position), tuple(scale), most)
