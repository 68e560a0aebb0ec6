"""A plan as ``paradiff plan`` prints it: a table, or JSON with ``--json``."""

from __future__ import annotations

from dataclasses import asdict

from .costs import one_device_step
from .job import Plan

HEADERS = ("strategy", "warm-up", "s/step", "total s", "speedup", "MB/step", "MB/rank", "exact")


def plan_json(plan: Plan) -> list[dict]:
    """One object per predicted setting (``strategy``, ``warmup_steps``, ``predicted_speedup``, ...)."""
    return [asdict(prediction) for prediction in plan.predictions]


def _machine_line(plan: Plan) -> str:
    hw = plan.hardware
    return (
        f"machine: {hw.name}: {hw.rate(plan.dtype) / 1e9:,.1f} GFLOP/s per rank, {hw.call_overhead_s * 1e3:.1f} ms "
        f"per call, link {hw.link_bytes_per_s / 1e9:.2f} GB/s and {hw.link_latency_s * 1e6:.0f} µs per collective, "
        f"{hw.overlap:.0%} of transfers hidden, {hw.shared_slowdown:.2f}× slower with every rank busy ({hw.source})"
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
            "—" if p.strategy in ("cfg", "ulysses", "ring") else str(p.warmup_steps),
            f"{p.predicted_step_s:.3g}",
            f"{p.predicted_total_s:.3g}",
            f"{p.predicted_speedup:.2f}×",
            f"{p.bytes_per_step / 2**20:.3g}",
            f"{p.memory_mb:,.0f}",
            "yes" if p.exact else "no",
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
    if fastest is not None and fastest is not exact:
        lines.append(f"fastest: {_setting(fastest)}")
    for strategy, reason in plan.refused.items():
        lines.append(f"not run: {strategy}: {' '.join(reason.split())}")
    return lines


def _setting(prediction) -> str:
    warmup = "" if prediction.strategy in ("cfg", "ulysses", "ring") else f", warm-up {prediction.warmup_steps}"
    return f"{prediction.label}{warmup} ({prediction.predicted_speedup:.2f}× predicted)"
