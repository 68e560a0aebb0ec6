"""Refuse a call whose setting cannot fit in one rank's device memory, before its denoiser runs.

Without this, a rank runs out of memory inside a step (the stale K/V buffers of a long video under ``patch`` grow
with the whole sequence), one rank first, and the others wait on it. The plan's memory model (what a rank keeps:
its weights and the strategy's buffers) is evaluated on the call's own denoiser inputs, traced on the meta device
at the first call of each shape, against one rank's device memory: ``device_memory`` when given (GiB, or a
hardware profile's GPU), else a CUDA device's total (the smallest over the ranks); on CPU ranks nothing is
checked. A refusal names the settings that fit.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist

from ..checks import check_parallelize
from ..errors import ParadiffError
from ..models import find_denoiser
from ..runtime.distributed import local_device
from ..strategies import strategy_class
from .calibrate import device_memory
from .costs import Fixed, Prediction, modelled, predict
from .hardware import PROFILES, hardware_profile
from .job import PlanJob, predictions, runnable_strategies
from .workload import pipeline_workload

#: Call arguments that change the denoiser's inputs' shapes (a new value is checked again).
SHAPE_ARGUMENTS = (
    "height",
    "width",
    "num_frames",
    "num_images_per_prompt",
    "prompt",
    "guidance_scale",
    "true_cfg_scale",
)
#: Arguments left out of the tracing call: a user's callback must not see a step that never ran.
TRACE_LEFT_OUT = ("callback_on_step_end", "callback", "callback_steps")


def memory_setting_bytes(setting, device: torch.device) -> float | None:
    """One rank's device memory: ``setting`` (GiB, or a hardware profile's GPU), else a CUDA device's total; None
    (not checked) on CPU."""
    if setting is None:
        return device_memory(device)
    if isinstance(setting, str):
        return hardware_profile(setting).memory_bytes
    return float(setting) * 2**30


def smallest_over_ranks(memory_bytes: float | None, group) -> float | None:
    """The smallest of every rank's ``memory_bytes`` over ``group`` (a collective where it is known: every rank
    alike, as the ranks agree on the setting and run on the same kind of device)."""
    if memory_bytes is None:
        return None
    figure = torch.tensor([memory_bytes], dtype=torch.float64, device=local_device())
    dist.all_reduce(figure, op=dist.ReduceOp.MIN, group=group)
    return float(figure.item())


def shape_key(kwargs: dict) -> tuple:
    """What of a call's arguments decides its denoiser inputs' shapes."""
    prompt = kwargs.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) else 1
    return tuple((name, prompts if name == "prompt" else kwargs.get(name)) for name in SHAPE_ARGUMENTS)


def call_steps(stock_call, kwargs: dict) -> int:
    """The call's inference steps: as passed, or the pipeline's default."""
    return kwargs.get("num_inference_steps") or inspect.signature(stock_call).parameters["num_inference_steps"].default


def call_refusal(pipe, stock_call, args: tuple, kwargs: dict, config, nproc: int, memory_bytes: float) -> str | None:
    """Why ``config`` cannot run the call ``stock_call(pipe, *args, **kwargs)`` on ``nproc`` ranks of
    ``memory_bytes`` each, naming the settings that fit; None when it fits. The call runs as far as its first
    denoiser call (prompt encoding), which is traced on the meta device; its callbacks are left out."""
    steps = call_steps(stock_call, kwargs)
    traced = {name: value for name, value in kwargs.items() if name not in TRACE_LEFT_OUT}

    def check(strategy: str, cfg_parallel: bool, **options) -> None:
        split = strategy_class(strategy).split_options(cfg_parallel)
        check_parallelize(pipe, strategy, world_size=nproc, height=kwargs.get("height"), **split, **options)

    dtype = next(find_denoiser(pipe).parameters()).dtype
    workload, _ = pipeline_workload(pipe, lambda: stock_call(pipe, *args, **{**traced, "output_type": "latent"}), dtype)
    hardware = dataclasses.replace(PROFILES["h100-nvlink"], memory_bytes=memory_bytes)  # rates do not matter here
    name = str(dtype).removeprefix("torch.")
    options = {field.name: getattr(config.options, field.name) for field in dataclasses.fields(config.options)}
    defaults = type(config.options)()
    asked = {key: value for key, value in options.items() if getattr(defaults, key) != value}
    if not modelled(config.strategy):
        return None  # no memory model to check against
    try:
        own = predict(
            workload, hardware, name, config.strategy, nproc, steps, config.warmup_steps, config.cfg_parallel, **asked
        )
    except ParadiffError:  # a loop the model needs more of (a diffusion-forcing schedule): not estimated here
        return None
    if own.fits:
        return None
    job = PlanJob(model=type(pipe).__name__, nproc=nproc, steps=steps, warmups=(config.warmup_steps,))
    runnable, _ = runnable_strategies(check, job, cfg_batch=True)
    fitting = [p.label for p in predictions(workload, hardware, name, job, runnable, Fixed()) if p.fits]
    return _refusal(own, memory_bytes, fitting)


def _refusal(own: Prediction, memory_bytes: float, fitting: list[str]) -> str:
    fits = f"fits: {', '.join(dict.fromkeys(fitting))}" if fitting else "nothing fits: use more ranks or a smaller size"
    return (
        f"{own.label} needs about {own.memory_mb:,.0f} MB per rank at this call's size, more than a device's "
        f"{memory_bytes / 2**20:,.0f} MB; {fits} (parallelize(..., device_memory=GiB) states a device's memory "
        "if this estimate is wrong)"
    )
