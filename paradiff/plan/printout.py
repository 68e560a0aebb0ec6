"""A plan as ``paradiff plan`` prints it: a table and what to run, or one JSON object with ``--json``.

Besides the predictions, a plan says how to run its pick (the fastest exact setting, else the fastest): the
``paradiff.parallelize(...)`` call to copy into a script, the ``torchrun`` line that launches it, and the
``paradiff generate`` command of the same setting; and, for a setting that is not exact, the ``paradiff bench``
command that measures how far its picture drifts from one device's (a plan predicts speed, not quality).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict

from ..loading import ALLOW_PICKLE_FLAG, default_size, default_steps
from .costs import Prediction, always_exact, call_s, one_device_step
from .hardware import MEASURED
from .job import PLAN_PROMPT, Plan

HEADERS = ("strategy", "warm-up", "s/step", "total s", "speedup", "MB/step", "MB/rank", "exact")
#: Why a setting has no ``paradiff generate`` / ``bench`` command: neither takes strategy options.
NO_COMMAND = "no paradiff generate command: generate and bench take no strategy options ({options}); use the call above"


def plan_json(plan: Plan) -> dict:
    """The plan as one object: what was planned, the machine, every prediction, the picks and what to run."""
    exact, fastest = plan.best(exact=True), plan.best(exact=False)
    pick = exact or fastest
    return {
        "model": plan.model,
        "size": plan.size,
        "width": plan.width or plan.size,
        "frames": plan.frames,
        "steps": plan.steps,
        "nproc": plan.nproc,
        "dtype": plan.dtype,
        "hardware": hardware_figures(plan),
        "predictions": [_row(plan, p) for p in plan.predictions],
        "fastest": None if fastest is None else _row(plan, fastest),
        "fastest_exact": None if exact is None else _row(plan, exact),
        "not_run": {strategy: " ".join(reason.split()) for strategy, reason in plan.refused.items()},
        "parallelize": None if pick is None else parallelize_call(pick),
        "launch": None if pick is None else launch_line(plan),
        "generate": None if pick is None else generate_command(plan, pick),
    }


def _row(plan: Plan, prediction: Prediction) -> dict:
    return {**asdict(prediction), "label": prediction.label, "bench": bench_command(plan, prediction)}


def hardware_figures(plan: Plan) -> dict:
    """The machine as a user can check it: one denoiser call on one device, one rank's band of it, the link."""
    hw, w = plan.hardware, plan.workload
    return {
        "name": hw.name,
        "source": hw.source,
        "ms_per_call": call_s(w, hw, plan.dtype) * 1e3,
        "ms_per_band": call_s(w, hw, plan.dtype, 1 / plan.nproc) * 1e3,
        "link_gb_s": hw.link_bytes_per_s / 1e9,
        "shared_slowdown": hw.shared_slowdown,
    }


def _machine_line(plan: Plan) -> str:
    figures, hw = hardware_figures(plan), plan.hardware
    if hw.name == MEASURED:
        where, timed = f"{MEASURED} ({hw.source.removeprefix('measured ')})", "timed"
    else:
        where, timed = f"{hw.name} (published figures)", "predicted"
    busy = f", {hw.shared_slowdown:.2f}× slower with every rank busy" if hw.shared_slowdown > 1.005 else ""
    return (
        f"machine: {where}: one denoiser call {figures['ms_per_call']:.3g} ms on one device and "
        f"{figures['ms_per_band']:.3g} ms over one rank's band of 1/{plan.nproc} of the rows ({timed}){busy}; "
        f"link {figures['link_gb_s']:.3g} GB/s"
    )


def plan_lines(plan: Plan) -> list[str]:
    w = plan.workload
    frames = f", {plan.frames} frames" if plan.frames else ""
    step = one_device_step(w, plan.hardware, plan.dtype)
    alone = plan.fixed.encode_s + plan.iterations * step + plan.fixed.decode_s
    loop = f" ({plan.iterations} iterations of frame blocks)" if plan.blocks is not None else ""
    unit = "iteration" if plan.blocks is not None else "step"
    lines = [
        f"{plan.model} ({w.model}) at {plan.pixels}{frames}, {plan.steps} steps{loop}, {plan.nproc} ranks, "
        f"{plan.dtype}: {w.step_flops / 1e12:.3g} TFLOP per {unit}",
        _machine_line(plan),
        f"one device: {step:.3g} s per {unit}, {alone:.3g} s in all (prompt {plan.fixed.encode_s:.2g} s, "
        f"decode {plan.fixed.decode_s:.2g} s)",
        "",
    ]
    rows = [
        [
            p.label,
            "—" if always_exact(p.strategy) else str(p.warmup_steps),
            f"{p.predicted_step_s:.3g}",
            f"{p.predicted_total_s:.3g}",
            f"{p.predicted_speedup:.2f}×",
            f"{p.bytes_per_step / 2**20:.3g}",
            f"{p.memory_mb:,.0f}",
            ("yes" if p.exact else "no") + ("" if p.fits else ", does not fit"),
        ]
        for p in sorted(plan.predictions, key=lambda p: -p.predicted_speedup)
    ]
    widths = [max(len(row[i]) for row in [list(HEADERS), *rows]) for i in range(len(HEADERS))]
    for row in [list(HEADERS), *rows]:
        lines.append(
            "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
        )
    lines.append("")
    exact, fastest = plan.best(exact=True), plan.best(exact=False)
    if exact is not None:
        lines.append(f"fastest exact: {_setting(exact)}")
    else:
        fits = " fits in a device's memory" if any(p.exact for p in plan.predictions) else f" runs {plan.model}"
        lines.append(f"fastest exact: none — no exact strategy{fits} on {plan.nproc} ranks")
    if fastest is not None and fastest is not exact:
        lines.append(f"fastest: {_setting(fastest)}, not exact")
    elif fastest is None:
        fits = " fits in a device's memory" if plan.predictions else f" runs {plan.model}"
        lines.append(f"fastest: none — no strategy{fits} on {plan.nproc} ranks")
    for strategy, reason in plan.refused.items():
        lines.append(f"not run: {strategy}: {' '.join(reason.split())}")
    if plan.unfit():
        lines.append(f"does not fit: {plan.unfit()}")
    return lines + _run_lines(plan, exact, fastest)


def _run_lines(plan: Plan, exact: Prediction | None, fastest: Prediction | None) -> list[str]:
    """How to run the pick (the fastest exact setting, else the fastest), and how to measure an inexact one."""
    pick = exact or fastest
    if pick is None:
        return []
    which = "the fastest exact" if pick is exact else "the fastest; not exact"
    lines = [
        "",
        f"to run {pick.label} ({which}):",
        f"  in your script: pipe = {parallelize_call(pick)}",
        f"  launch it with: {launch_line(plan)}",
        f"  or run: {_or_why(generate_command(plan, pick), pick)}",
    ]
    if any(not p.exact for p in plan.predictions):
        lines.append("the plan predicts speed, not quality: measure how far an inexact setting's picture drifts from")
        lines.append("one device's (PSNR) before you use it:")
        shown = fastest if fastest is not None and not fastest.exact else None
        own = None if shown is None else bench_command(plan, shown)
        if own is not None:
            lines.append(f"  {shown.label}: {own}")
        every = bench_command(plan, None)
        if every is not None and every != own:
            lines.append(f"  every inexact row bench runs: {every}")
        if own is None and every is None:
            lines.append("  (bench runs no setting with strategy options: compare the call above with one device's)")
    return lines


def _setting(prediction: Prediction) -> str:
    warmup = "" if always_exact(prediction.strategy) else f", warm-up {prediction.warmup_steps}"
    return f"{prediction.label}{warmup} ({prediction.predicted_speedup:.2f}× predicted)"


def _or_why(command: str | None, prediction: Prediction) -> str:
    """``command``, or why the command line has none for ``prediction`` (it takes no strategy options)."""
    options = [*(["cfg_parallel=True"] if prediction.cfg_parallel else []), *_keywords(prediction.options)]
    return command or NO_COMMAND.format(options=", ".join(options))


def _keywords(options: dict) -> list[str]:
    return [f"{name}={json.dumps(value)}" for name, value in options.items()]


def parallelize_call(prediction: Prediction) -> str:
    """The ``paradiff.parallelize`` call that runs ``prediction``'s setting."""
    arguments = [f'strategy="{prediction.strategy}"']
    if not always_exact(prediction.strategy):
        arguments.append(f"warmup_steps={prediction.warmup_steps}")
    if prediction.cfg_parallel:
        arguments.append("cfg_parallel=True")
    arguments += _keywords(prediction.options)
    return f"paradiff.parallelize(pipe, {', '.join(arguments)})"


def launch_line(plan: Plan) -> str:
    return f"torchrun --nproc-per-node {plan.nproc} your_script.py"


def _cli_model(plan: Plan) -> str:
    """The ``--model`` the command line loads: the plan's, or an architecture's hub repository."""
    from .architectures import architecture, architecture_names

    return architecture(plan.model).hub_id if plan.model in architecture_names() else plan.model


def _workload_options(plan: Plan, frames: bool) -> list[str]:
    """The options that make ``generate`` / ``bench`` call the pipeline as the plan traced it."""
    job = plan.job
    words = [] if plan.steps == default_steps(plan.model) else ["--steps", str(plan.steps)]
    if plan.size != default_size(plan.model):
        words += ["--size", str(plan.size)]
    if plan.width not in (None, plan.size):
        words += ["--width", str(plan.width)]
    if frames and job is not None and job.frames is not None:
        words += ["--frames", str(job.frames)]
    if job is None:
        return words
    for key, value in job.call:
        words += ["--call", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    if job.device != "auto":
        words += ["--device", job.device]
    if job.dtype != "auto":
        words += ["--dtype", job.dtype]
    if job.allow_pickle:
        words.append(ALLOW_PICKLE_FLAG)
    return words


def generate_command(plan: Plan, prediction: Prediction) -> str | None:
    """The ``paradiff generate`` command of ``prediction``'s setting (drawing the prompt the plan traced); None if it
    takes options generate has not."""
    if prediction.cfg_parallel or prediction.options:
        return None
    words = ["paradiff", "generate", "--model", _cli_model(plan), "--strategy", prediction.strategy]
    if not always_exact(prediction.strategy):
        words += ["--warmup", str(prediction.warmup_steps)]
    words += ["--nproc", str(plan.nproc), *_workload_options(plan, frames=True)]
    return shlex.join([*words, PLAN_PROMPT])  # the prompt the plan traced: replace it with yours


def bench_command(plan: Plan, prediction: Prediction | None) -> str | None:
    """The ``paradiff bench`` command that measures an inexact setting's speed and quality against one device (one
    prompt); with None, every inexact row the bench can run. None for an exact setting, or one with options."""
    if prediction is None:
        settings = [p for p in plan.predictions if not p.exact and not p.cfg_parallel and not p.options]
    elif prediction.exact or prediction.cfg_parallel or prediction.options:
        return None
    else:
        settings = [prediction]
    if not settings:
        return None
    strategies = list(dict.fromkeys(p.strategy for p in settings))
    warmups = sorted({p.warmup_steps for p in settings})
    words = ["paradiff", "bench", "--model", _cli_model(plan), "--strategies", ",".join(strategies)]
    words += ["--warmup", ",".join(map(str, warmups)), "--nproc", str(plan.nproc), "--prompts", "1"]
    return shlex.join([*words, *_workload_options(plan, frames=False)])
