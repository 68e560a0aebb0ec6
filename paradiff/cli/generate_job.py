"""What every rank does in ``paradiff generate``: load, check everything, then draw (reference first).

Every rank loads the pipeline and runs the same checks (:func:`plan_generate`) before anything is drawn:
the frame count and the output file against the pipeline's kind (image or video), the guidance against
the CFG split, and the strategy against the model, the world size and the height
(:func:`paradiff.check_parallelize`, no collective). A refusal is a :class:`ParadiffError` on every rank,
which the launcher hands back as one line and exit status 2. Only then does rank 0 draw the one-device
reference (its progress bar labelled ``one device``) and every rank the parallel image (``2 ranks, patch``).
"""

from __future__ import annotations

import inspect
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from ..config import check_world
from ..devices import rank_device, torch_dtype
from ..errors import ParadiffError, ParadiffWarning
from ..loading import (
    PER_PROMPT_ARGUMENTS,
    RANDOM_MODELS,
    TRAINED_MODELS,
    default_height,
    frames_parameter,
    frames_refusal,
    load_pipeline,
    makes_video,
    model_index,
    prompt_kwargs,
    size_kwargs,
    video_model,
    warn_if_cut,
)
from .output_files import IMAGE_SUFFIXES, VIDEO_SUFFIXES, check_writable, output_kind, output_paths, write_outputs
from .summary import format_duration


@dataclass(frozen=True)
class GenerateJob:
    #: Prompt i is drawn from seed ``seed + i``.
    prompts: tuple[str, ...]
    model: str
    strategy: str
    nproc: int
    steps: int
    size: int | None
    frames: int | None
    seed: int
    #: Steps after the first run in sync; None: ``parallelize``'s default (4, or 0 under a fidelity floor).
    warmup: int | None
    out: str | None
    baseline: bool
    threads: int
    device: str = "auto"  # auto (CUDA when present), cuda or cpu
    dtype: str = "auto"  # auto (float16 on CUDA, float32 on CPU) or one of devices.DTYPES
    guidance: float | None = None
    negative_prompt: str | None = None
    allow_pickle: bool = False
    #: More arguments of the pipeline's call (``--call``), as ``(key, value)`` pairs.
    call: tuple = ()
    #: Width in pixels when it differs from ``size`` (the height).
    width: int | None = None
    #: Replace output files that exist.
    overwrite: bool = False
    #: The longest a collective waits for another rank (``parallelize``'s ``timeout_s``).
    timeout_s: float = 600.0
    #: ``parallelize``'s ``fidelity_floor_db``: the PSNR floor the staleness guard holds (None: no guard).
    fidelity_floor: float | None = None

    @property
    def staleness_options(self) -> dict:
        """What ``parallelize`` takes of the warm-up and the fidelity floor (only what was asked)."""
        options = {} if self.warmup is None else {"warmup_steps": self.warmup}
        return options if self.fidelity_floor is None else {**options, "fidelity_floor_db": self.fidelity_floor}

    @property
    def phase(self) -> str:
        """The label of the parallel run's progress bar and summary line: ``one device``, ``2 ranks, patch``."""
        return "one device" if self.nproc == 1 else f"{self.nproc} ranks, {self.strategy}"


@dataclass(frozen=True)
class GeneratePlan:
    """What the checks settled: the call's keyword arguments, the pictures per prompt and where they go."""

    call_kwargs: dict
    paths: list[Path]
    video: bool
    per_prompt: int


def _bins_resolution(pipe, inputs: dict) -> bool:
    parameter = inspect.signature(type(pipe).__call__).parameters.get("use_resolution_binning")
    return parameter is not None and inputs.get("use_resolution_binning", parameter.default) is True


def _guidance(pipe, inputs: dict) -> float | None:
    parameter = inspect.signature(type(pipe).__call__).parameters.get("guidance_scale")
    value = inputs.get("guidance_scale", None if parameter is None else parameter.default)
    return value if isinstance(value, (int, float)) else None


def check_picture_kind(name: str, video: bool, takes_frames: bool, out: str | None, frames: int | None) -> None:
    """Refuse ``--frames`` for a pipeline that takes no frame count, and an ``--out`` file of the other kind.

    The parent runs it for the built-in models, whose kind it knows before any worker starts; every rank runs
    it again on the loaded pipeline (``name`` is ``"model (PipelineClass)"``).
    """
    if frames is not None and not takes_frames:
        raise ParadiffError(f"--frames is for video pipelines, and {name} makes images; drop --frames")
    kind = "video" if video else "image"
    wanted = output_kind(out)
    if wanted is not None and wanted != kind:
        allowed = ", ".join(VIDEO_SUFFIXES if video else IMAGE_SUFFIXES)
        raise ParadiffError(f"--out {out} is a file for {wanted}s, and {name} makes {kind}s: use {allowed}")


def plan_generate(pipe, job: GenerateJob, inputs: dict) -> GeneratePlan:
    """Every check that needs the loaded pipeline, before anything is drawn; the call's arguments and output.

    Raises a :class:`ParadiffError` on every rank alike (no collective is involved).
    """
    import paradiff

    video = makes_video(pipe)
    kind = "video" if video else "image"
    name = f"{job.model} ({type(pipe).__name__})"
    call_kwargs = size_kwargs(job.size, job.width)
    frames = frames_parameter(pipe)
    check_picture_kind(name, video, frames is not None, job.out, job.frames)
    if job.frames is not None:
        refusal = frames_refusal(pipe, job.frames)
        if refusal is not None:
            raise ParadiffError(f"{name} {refusal}")
        call_kwargs[frames] = job.frames
    guidance = _guidance(pipe, inputs)
    per_prompt = pictures_per_prompt(pipe, inputs)
    paths = output_paths(job.out, kind, per_prompt * len(job.prompts))
    check_writable(paths, job.overwrite)
    if job.nproc > 1 and job.strategy == "cfg" and guidance is not None and guidance <= 1:
        raise ParadiffError(
            f"strategy='cfg' runs the two halves of classifier-free guidance on two ranks, and at guidance "
            f"{guidance:g} the pipeline runs no guidance; pass --guidance above 1, or another strategy"
        )
    if job.nproc > 1 and job.strategy != "auto":  # one rank runs the pipeline as it is; auto decides at its call
        height = None if _bins_resolution(pipe, inputs) else job.size or default_height(pipe)
        paradiff.check_parallelize(pipe, job.strategy, world_size=job.nproc, height=height, **job.staleness_options)
    return GeneratePlan(call_kwargs, paths, video, per_prompt)


def _picture_count(value) -> int:
    return value if isinstance(value, int) and value > 0 else 1


def pictures_per_prompt(pipe, inputs: dict) -> int:
    """How many images (or videos) one prompt makes: the call's ``num_images_per_prompt`` (or videos), default 1."""
    parameters = inspect.signature(type(pipe).__call__).parameters
    for name in PER_PROMPT_ARGUMENTS:
        if name in parameters:
            return _picture_count(inputs.get(name, parameters[name].default))
    return 1


def check_outputs(job: GenerateJob) -> None:
    """What the parent checks of the outputs before any worker starts: the files they go to (refused if they
    exist or cannot be written) and, for the built-in models, whose kind it knows, ``--frames`` and ``--out``'s
    kind. A model read from a folder or the hub is checked again, as what it makes, once loaded."""
    video = video_model(job.model)
    if job.model in TRAINED_MODELS:
        check_picture_kind(f"{job.model} ({model_index(job.model)['_class_name']})", video, video, job.out, job.frames)
    kind = output_kind(job.out) or ("video" if video else "image")
    call = dict(job.call)
    per_prompt = _picture_count(next((call[name] for name in PER_PROMPT_ARGUMENTS if name in call), 1))
    check_writable(output_paths(job.out, kind, len(job.prompts) * per_prompt), job.overwrite)


#: A run whose denoising on one device takes at least this long (s) is announced, with the estimate, before it starts.
LONG_RUN_S = 600.0


def check_run_length(pipe, job: GenerateJob, inputs: dict, plan: GeneratePlan, device, dtype) -> None:
    """Before drawing, at a size far beyond the model's own: refuse a one-device reference that takes longer than
    the other ranks wait for it (``--timeout``), and warn of a run that takes long. Rank 0 estimates (a lower
    bound); every rank acts on its verdict alike.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    verdict = [_run_length(pipe, job, inputs, plan, device, dtype) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        return
    refused, message = verdict[0]
    if refused:
        raise ParadiffError(message)
    if rank == 0:
        warnings.warn(message, ParadiffWarning, stacklevel=2)


def _run_length(pipe, job: GenerateJob, inputs: dict, plan: GeneratePlan, device, dtype) -> tuple[bool, str] | None:
    """``(refused, message)`` for a run that takes long, None otherwise; up to twice the model's own size on each
    side nothing is estimated (it costs a traced call)."""
    from ..plan.estimate import denoising_seconds_at_least
    from ..plan.workload import PLAN_STEPS

    own = default_height(pipe)
    height = job.size or own
    width = job.width or height
    if own is None or height is None or height * width <= 4 * own**2:
        return None

    def call():
        pipe.set_progress_bar_config(disable=True)  # a traced call, not a picture; draw() sets the bar again
        return pipe(**inputs, **plan.call_kwargs, num_inference_steps=PLAN_STEPS, output_type="latent")

    seconds, flops = denoising_seconds_at_least(pipe, call, job.steps, device, dtype)
    least = f"at {height}×{width} px, {job.steps} steps on one {device.type} device take at least "
    least += format_duration(seconds)
    cost = f"here ({flops:.2g} FLOP per denoiser call)"
    reference = job.baseline and job.nproc > 1
    if reference and seconds > job.timeout_s:
        return True, (
            f"{least} {cost}, longer than the other ranks wait for the one-device reference (--timeout "
            f"{job.timeout_s:g} s); pass --no-baseline, --timeout {2 * seconds:.0f}, or a smaller --size"
        )
    if seconds > LONG_RUN_S:
        first = "; the one-device reference runs first (--no-baseline skips it)" if reference else ""
        return False, f"{least} {cost}{first}; a smaller --size is quicker"
    return None


def loads_by_stage(job: GenerateJob) -> bool:
    """Whether each rank loads only its stage of the blocks: ``pipefusion`` or ``dualparal`` without the one-device
    reference (which needs the whole model) on a model read from files."""
    from ..stages.load_stage import STAGED

    return job.nproc > 1 and job.strategy in STAGED and not job.baseline and job.model not in RANDOM_MODELS


def generate_on_rank(job: GenerateJob) -> dict:
    """Load, check, draw the references on rank 0 (the same device and dtype), then the pictures on every rank.

    Rank 0 returns its report (:func:`paradiff.cli.summary.summary_lines` reads it): the files written, the
    seconds of every call and, after the references, the speedup and PSNR; the communication counters after
    a parallel run; each rank's peak memory. The other ranks return ``{}``.
    """
    import torch
    import torch.distributed as dist

    import paradiff

    from ..memory import PeakMemory
    from ..metrics import psnr
    from ..runtime.distributed import ensure_process_group
    from ..stages.load_stage import load_stage_pipeline

    torch.set_num_threads(job.threads)
    check_world(job.strategy, job.nproc)
    if job.nproc > 1:
        ensure_process_group(timedelta(seconds=job.timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = rank_device(job.device)
    dtype = torch_dtype(job.dtype, device)
    with PeakMemory(device) as loading:
        if loads_by_stage(job):
            pipe = load_stage_pipeline(job.model, strategy=job.strategy, dtype=dtype, device=device)
        else:
            pipe = load_pipeline(job.model, dtype=dtype, allow_pickle=job.allow_pickle).to(device)
    calls = [
        prompt_kwargs(
            pipe, job.model, prompt, guidance=job.guidance, negative_prompt=job.negative_prompt, extra=job.call
        )
        for prompt in job.prompts
    ]
    plan = plan_generate(pipe, job, calls[0])
    for prompt, inputs in zip(job.prompts, calls, strict=True):
        warn_if_cut(pipe, prompt, inputs)
    if not loads_by_stage(job):
        check_run_length(pipe, job, calls[0], plan, device, dtype)

    calibration_s = []

    def draw(label: str, parallel: bool = False) -> tuple[list[np.ndarray], list[float]]:
        """Each call's pictures and seconds; the seconds a call spent calibrating the staleness guard are kept apart
        (the first call of a size calibrates it, later ones and later runs reuse it)."""
        outputs, seconds = [], []
        for index, inputs in enumerate(calls):
            shown = label if len(calls) == 1 else f"{label} ({index + 1}/{len(calls)})"
            pipe.set_progress_bar_config(desc=shown, disable=rank != 0)
            start = time.perf_counter()
            result = pipe(
                **inputs,
                **plan.call_kwargs,
                num_inference_steps=job.steps,
                generator=torch.Generator().manual_seed(job.seed + index),
                output_type="np",
            )
            calibrating = paradiff.comm_stats(pipe).get("guard", {}).get("calibration_s", 0.0) if parallel else 0.0
            calibration_s.append(calibrating)
            seconds.append(time.perf_counter() - start - calibrating)
            outputs.append(_output_of(result))
        return outputs, seconds

    baseline = baseline_s = None
    if job.nproc > 1:
        if job.baseline and rank == 0:
            baseline, baseline_s = draw("one device")
        dist.barrier()
        pipe = paradiff.parallelize(pipe, strategy=job.strategy, timeout_s=job.timeout_s, **job.staleness_options)
    with PeakMemory(device) as generating:
        outputs, seconds = draw(job.phase, parallel=job.nproc > 1)
    peaks = [(loading.bytes, generating.bytes)]
    if job.nproc > 1:
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (loading.bytes, generating.bytes))
    if rank != 0:
        return {}
    pictures = np.concatenate(outputs)
    paths = plan.paths if len(plan.paths) == len(pictures) else output_paths(job.out, _kind(plan), len(pictures))
    report = {"files": write_outputs(pictures, paths), "prompts": list(job.prompts), "latency_s": sum(seconds)}
    report["pictures"] = _pictures(job, report["files"], outputs, seconds, baseline, baseline_s, psnr)
    report["loaded_by_stage"] = loads_by_stage(job)
    report["peak_memory_mb"] = {
        phase: [None if peak[i] is None else peak[i] / 2**20 for peak in peaks]
        for i, phase in enumerate(("loading", "generating"))
    }
    if baseline is not None:
        worst = min(picture["psnr_db"] for picture in report["pictures"])
        report.update(baseline_s=sum(baseline_s), speedup=sum(baseline_s) / sum(seconds), psnr_db=worst)
    if job.nproc > 1:
        report.update(paradiff.comm_stats(pipe))
        report["calibration_s"] = sum(calibration_s)
        if job.strategy == "auto":
            report["picked"] = paradiff.plan_of(pipe).reason
    return report


def _kind(plan: GeneratePlan) -> str:
    return "video" if plan.video else "image"


def _pictures(job, files, outputs, seconds, baseline, baseline_s, psnr) -> list[dict]:
    """One entry per picture written: its file, prompt, seed, the seconds of its call, and its PSNR."""
    pictures, number = [], 0
    for index, (output, call_s) in enumerate(zip(outputs, seconds, strict=True)):
        for image in range(len(output)):
            picture = {"file": files[number], "prompt": job.prompts[index], "seed": job.seed + index, "seconds": call_s}
            if baseline is not None:
                picture.update(
                    one_device_seconds=baseline_s[index], psnr_db=psnr(output[image], baseline[index][image])
                )
            pictures.append(picture)
            number += 1
    return pictures


def _output_of(result) -> np.ndarray:
    """An image pipeline's images ``(B, H, W, 3)`` or a video pipeline's frames ``(B, F, H, W, 3)``."""
    frames = getattr(result, "frames", None)
    return np.asarray(result.images if frames is None else frames)
