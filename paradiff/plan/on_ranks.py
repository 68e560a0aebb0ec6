"""A plan for a model ``paradiff generate`` can load: traced from its pipeline's call, timed on the ranks."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..checks import check_parallelize
from ..devices import rank_device, torch_dtype
from ..errors import ParadiffError
from ..loading import default_height, default_size, frames_parameter, frames_refusal, load_pipeline, prompt_kwargs
from ..models import decoder_family_of, family_of, find_denoiser
from ..models.base import bind_inputs
from ..runtime.distributed import ensure_process_group
from ..strategies import strategy_class
from ..strategies.dualparal import makes_block_schedules
from .calibrate import calibrate, fastest
from .costs import Fixed
from .forcing_loop import block_loop
from .hardware import hardware_profile
from .job import PLAN_PROMPT, Plan, PlanJob, predictions, runnable_strategies
from .workload import PLAN_STEPS, denoiser_skipped, pipeline_workload


def part_height(pipe, height: int, nproc: int) -> int:
    """The height of one rank's band of ``height`` (whole rows of the denoiser's latent patches)."""

    scale = int(getattr(pipe, "vae_scale_factor", 8))
    denoiser = find_denoiser(pipe)
    try:
        pixels = family_of(denoiser).pixels_per_row(denoiser, scale)
    except ParadiffError:
        pixels = 2 * scale
    return max(pixels, height // nproc // pixels * pixels)


def plan_on_rank(job: PlanJob) -> Plan | None:
    """Load, trace, time (without a hardware profile) and predict; rank 0 returns the plan.

    With a hardware profile nothing is timed: one process (rank 0, no process group) traces and predicts.
    """

    torch.set_num_threads(job.threads)
    if job.nproc > 1 and job.hardware is None:
        ensure_process_group(timedelta(seconds=job.timeout_s))
    device = rank_device(job.device)
    dtype = torch_dtype(job.dtype, device)
    pipe = load_pipeline(job.model, dtype=dtype, allow_pickle=job.allow_pickle).to(device)
    pipe.set_progress_bar_config(disable=True)
    inputs = prompt_kwargs(pipe, job.model, PLAN_PROMPT, extra=job.call)
    size = job.size or default_size(job.model) or default_height(pipe)
    if size is None:
        raise ParadiffError(f"{job.model} does not say what size it draws at; pass --size")
    if job.frames is not None:
        frames = frames_parameter(pipe)
        if frames is None:
            raise ParadiffError(f"--frames is for video pipelines, and {job.model} makes images; drop --frames")
        refusal = frames_refusal(pipe, job.frames)
        if refusal is not None:
            raise ParadiffError(f"{job.model} {refusal}")
        inputs[frames] = job.frames

    def call(height: int, steps: int, output_type: str):
        generator = torch.Generator().manual_seed(0)
        return pipe(
            **inputs,
            height=height,
            width=job.width or size,
            num_inference_steps=steps,
            output_type=output_type,
            generator=generator,
        )

    return plan_pipeline(pipe, call, size, job, device)


def plan_pipeline(pipe, call: Callable, size: int, job: PlanJob, device) -> Plan | None:
    """The plan of ``pipe``'s calls at ``size`` px: ``call(height, steps, output_type)`` makes one.

    A collective when no hardware profile is named (every rank of the default group times its part); rank 0
    returns the plan.
    """

    rank = dist.get_rank() if dist.is_initialized() else 0
    denoiser = find_denoiser(pipe)
    dtype = next(denoiser.parameters()).dtype
    workload, full = pipeline_workload(pipe, lambda: call(size, PLAN_STEPS, "latent"), dtype)
    family = family_of(denoiser, any_model=True)
    forcing = family.frame_blocks is not None and makes_block_schedules(pipe)
    blocks = block_loop(pipe, lambda: call(size, job.steps, "latent"), dtype, (workload, full)) if forcing else None
    start = time.perf_counter()
    part_size = part_height(pipe, size, max(job.nproc, 2))
    part_workload, part = pipeline_workload(pipe, lambda: call(part_size, PLAN_STEPS, "latent"), dtype)
    encode_s = time.perf_counter() - start

    def run(captured):
        with torch.no_grad():
            denoiser(*captured.args, **captured.kwargs)

    name = str(dtype).removeprefix("torch.")
    fixed = Fixed()
    if job.hardware is None:
        if rank == 0:
            with denoiser_skipped(pipe, dtype):  # not 1 step: PixArt's one-step path fails under DPM-Solver++
                decode_s = fastest(lambda: call(size, PLAN_STEPS, "pil"), device, repeats=1) - encode_s
            decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
            banded = decoder is not None and decoder_family_of(decoder) is not None
            fixed = Fixed(encode_s=encode_s, decode_s=max(decode_s, 0.0), decode_banded=banded)
        hardware = calibrate(lambda: run(full), lambda: run(part), workload.flops, part_workload.flops, name, device)
    else:
        hardware = hardware_profile(job.hardware)
    if rank != 0:
        return None

    def check(strategy: str, cfg_parallel: bool, **options) -> None:
        split = strategy_class(strategy).split_options(cfg_parallel)
        check_parallelize(pipe, strategy, world_size=job.nproc, height=size, **split, **options)

    latent_batch = bind_inputs(denoiser, full.args, full.kwargs).arguments[family.latent_arg].shape[0]
    runnable, refused = runnable_strategies(check, job, latent_batch % 2 == 0 or workload.calls_per_step == 2)
    for strategy in list(runnable):
        why = strategy_class(strategy).plan_refusal(forcing, block_loop=blocks is not None)
        if why is not None:
            del runnable[strategy]
            refused[strategy] = why
    rows = predictions(workload, hardware, name, job, runnable, fixed, blocks)
    return Plan(
        job.model,
        size,
        job.frames,
        job.steps,
        job.nproc,
        name,
        hardware,
        workload,
        fixed,
        rows,
        refused,
        blocks,
        job.width,
        job,
    )
