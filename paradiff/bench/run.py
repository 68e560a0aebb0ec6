"""What every rank does in ``paradiff bench``: the same prompts and seeds through every run, timed.

Runs share one pipeline instance: the one-device baseline runs on rank 0 while the other ranks wait
at a barrier (one image at a time, so no wait outlasts one image), then each strategy × warm-up is
``parallelize``d, run on every rank and ``unparallelize``d. A run with a step cache (``--cache``) puts the cache
on the denoiser before ``parallelize`` and takes it off after, and starts it afresh for each image. Rank 0
returns the outputs (images, or the frames of a video pipeline) and timings.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import paradiff

from ..caches import parse_cache
from ..caches.presets import apply_cache, reset_cache
from ..config import check_world
from ..devices import rank_device, torch_dtype
from ..loading import load_pipeline, makes_video, prompt_kwargs, size_kwargs
from ..runtime.distributed import ensure_process_group, env_world_size
from .job import BenchJob, RunSpec

#: The preflight image's steps: the fewest that take every pipeline's ordinary path (see ``_preflight``).
PREFLIGHT_STEPS = 2


@dataclass
class RunResult:
    """One run over every prompt: outputs in [0, 1], seconds, and communication per output.

    An output is an (H, W, 3) image, or the (F, H, W, 3) frames of a video pipeline's video.
    """

    spec: RunSpec
    outputs: list[np.ndarray] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    bytes_per_step: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    #: Under a fidelity floor: the steps the staleness guard refreshed, per output.
    refreshed_steps: list[list[int]] = field(default_factory=list)
    #: The run-time choices that changed its pictures (``comm_stats``' ``layout``: ``asyncdiff``'s measured cut).
    layout: dict | None = None

    def add(self, output: np.ndarray, seconds: float, comm: dict) -> None:
        self.outputs.append(output)
        self.latency_s.append(seconds)
        self.bytes_per_step.append(float(comm.get("bytes_per_step", 0.0)))
        self.wait_s.append(float(comm.get("wait_s", 0.0)))
        if "guard" in comm:
            self.refreshed_steps.append(list(comm["guard"]["refreshed_steps"]))
        self.layout = comm.get("layout", self.layout)


@dataclass
class BenchResults:
    prompts: list[str]
    runs: list[RunResult]
    world_size: int
    device: str
    dtype: str | None = None  # what every run computed in, e.g. "float32"


def bench_on_rank(job: BenchJob) -> BenchResults | None:
    """Every run on this rank; rank 0 returns the results, the other ranks None."""
    torch.set_num_threads(job.threads)
    for strategy in job.strategies:
        check_world(strategy, job.nproc)
    world_size = env_world_size()
    if world_size > 1:
        ensure_process_group(timedelta(seconds=job.timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = rank_device(job.device)
    dtype = torch_dtype(job.dtype, device)
    pipe = load_pipeline(job.model, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=rank != 0)
    prompts = job.prompt_list(video=makes_video(pipe))
    inputs = [
        prompt_kwargs(
            pipe, job.model, prompt, guidance=job.guidance, negative_prompt=job.negative_prompt, extra=job.call
        )
        for prompt in prompts
    ]
    specs = job.runs()
    _check_caches(pipe, job, specs, world_size)
    _preflight(pipe, job, specs[1], inputs[0])
    runs = []
    for number, spec in enumerate(specs, start=1):
        runs.append(_run(pipe, job, spec, inputs, rank, world_size, f"[bench] {number}/{len(specs)} {spec.label}"))
    if rank != 0:
        return None
    return BenchResults(prompts, runs, world_size, _device_name(pipe.device), str(dtype).removeprefix("torch."))


def _preflight(pipe, job: BenchJob, spec: RunSpec, inputs: dict) -> None:
    """One untimed short image through the first strategy, before anything is timed.

    Every rank fails here at once if the size cannot be split (rather than after the baseline), and
    first-call costs (allocations, connections) stay out of the timings.
    """
    with _parallelized(pipe, spec, job.timeout_s):
        # 2, not 1: PixArt takes a one-step path for 1 that indexes a scheduler result DPM-Solver does not return
        _generate(pipe, inputs, size_kwargs(job.size, job.width), PREFLIGHT_STEPS, job.seed)
    _barrier()


def _check_caches(pipe, job: BenchJob, specs: list[RunSpec], world_size: int) -> None:
    """Refuse, before anything runs, a cache that a strategy of the job cannot run (every rank alike)."""
    for spec in specs:
        if spec.cache is not None and spec.strategy is not None:
            with _cached(pipe, spec, job.steps):
                paradiff.check_parallelize(pipe, strategy=spec.strategy, world_size=world_size)


def _run(pipe, job: BenchJob, spec: RunSpec, inputs: list[dict], rank: int, world_size: int, title: str) -> RunResult:
    """Every prompt through one run; the baseline only on rank 0, every run starting on all ranks together."""
    run = RunResult(spec)
    parallel = spec.strategy is not None
    with _cached(pipe, spec, job.steps), _parallelized(pipe, spec, job.timeout_s):
        for index, kwargs in enumerate(inputs):
            _barrier()
            if parallel or rank == 0:
                if spec.cache is not None:
                    reset_cache(pipe)
                output, seconds = _generate(pipe, kwargs, size_kwargs(job.size, job.width), job.steps, job.seed + index)
                stats = paradiff.comm_stats(pipe) if parallel and world_size > 1 else {}
                seconds -= stats.get("guard", {}).get("calibration_s", 0.0)  # once per size: not the run's speed
                run.add(output, seconds, stats)
                if rank == 0:
                    line = f"{title}: prompt {index + 1}/{len(inputs)} ... {seconds:.2f} s"
                    print(line, file=sys.stderr if job.json else sys.stdout, flush=True)
        _barrier()
    return run


@contextmanager
def _cached(pipe, spec: RunSpec, steps: int):
    """``spec``'s step cache on ``pipe``'s denoiser inside the block (none when it names none)."""
    if spec.cache is None:
        yield
        return
    name, settings = parse_cache(spec.cache)
    remove = apply_cache(pipe, name, steps, settings)
    try:
        yield
    finally:
        remove()


@contextmanager
def _parallelized(pipe, spec: RunSpec, timeout_s: float):
    """``pipe`` parallelized as ``spec`` says inside the block (as it is for the baseline or on one rank)."""
    if spec.strategy is None:
        yield
        return
    paradiff.parallelize(pipe, strategy=spec.strategy, timeout_s=timeout_s, **spec.options)
    try:
        yield
    finally:
        paradiff.unparallelize(pipe)


def _generate(pipe, inputs: dict, sizes: dict, steps: int, seed: int) -> tuple[np.ndarray, float]:
    """The first image (H, W, 3), or a video pipeline's first video (F, H, W, 3), and the seconds it took."""
    start = time.perf_counter()
    result = pipe(
        **inputs,
        **sizes,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )
    seconds = time.perf_counter() - start
    frames = getattr(result, "frames", None)
    return np.asarray(result.images if frames is None else frames)[0], seconds


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
