"""What the ``paradiff`` command prints after a run: its summary in words, or one JSON object.

Quiet output (third-party warnings, logs and loading bars off) lives in :mod:`paradiff.launch.quiet`.
"""

from __future__ import annotations

import math
import sys


def times_sign() -> str:
    """``×``, or ``x`` where stdout cannot encode it."""
    try:
        "×".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "x"
    return "×"


def format_speedup(speedup: float, times: str = "×") -> str:
    """``"1.8× faster"``, ``"4.0× slower"`` (for 0.25), or ``"as fast as one device"`` within 5%."""
    if not math.isfinite(speedup) or speedup <= 0:
        return "speed not measured"
    if 1 / 1.05 < speedup < 1.05:
        return "as fast as one device"
    if speedup >= 1:
        return f"{speedup:.1f}{times} faster"
    return f"{1 / speedup:.1f}{times} slower"


#: Above this PSNR two images differ by float round-off only (8-bit output differs below about 50 dB).
ROUND_OFF_DB = 100.0


def format_fidelity(psnr_db: float) -> str:
    """How close the image is to one device's: identical, equal within float round-off, or its PSNR."""
    if math.isinf(psnr_db) and psnr_db > 0:
        return "identical to one device"
    if psnr_db >= ROUND_OFF_DB:
        return f"equal to one device within float round-off (PSNR {psnr_db:.0f} dB)"
    return f"PSNR {psnr_db:.1f} dB against one device"


def format_bytes(count: float) -> str:
    """``"512 B"``, ``"26.0 kB"``, ``"470 kB"``, ``"33.4 MB"``, ``"1.2 GB"`` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"
    return f"{count:.0f} B"


def format_duration(seconds: float) -> str:
    """``40 s``, ``12 min``, ``9.1 h``: a duration as a person reads it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def summary_lines(report: dict, phase: str, times: str = "×") -> list[str]:
    """The lines ``paradiff generate`` prints after a run: the files, each phase's time, speed, fidelity, traffic.

    ``report`` is rank 0's: ``files``, ``latency_s`` (every call together) and, after the reference runs,
    ``baseline_s``, ``speedup`` and ``psnr_db`` (the lowest over the pictures); after a parallel run
    ``bytes_per_step`` and ``wait_s``; ``peak_memory_mb`` (per rank, of the loading and of the run) and
    ``loaded_by_stage``. ``phase`` names the run (``"one device"`` or ``"2 ranks, patch"``).
    """
    files = report["files"]
    lines = [f"wrote {files[0]}" if len(files) == 1 else f"wrote {len(files)} files: {', '.join(files)}"]
    if "baseline_s" in report:
        lines.append(f"one device: {report['baseline_s']:.2f} s")
    line = f"{phase}: {report['latency_s']:.2f} s"
    if "speedup" in report:
        fidelity = format_fidelity(report["psnr_db"])
        fidelity = fidelity if len(files) == 1 else f"{fidelity} (the least close picture)"
        line += f", {format_speedup(report['speedup'], times)}, {fidelity}"
    lines.append(line)
    if "picked" in report:
        lines.append(f"auto picked {report['picked']}")
    if "guard" in report:
        lines.append(guard_line(report["guard"], report.get("calibration_s", 0.0)))
    if "bytes_per_step" in report:
        lines.append(
            f"traffic: {format_bytes(report['bytes_per_step'])} per step per rank, "
            f"{report['wait_s']:.2f} s waiting for other ranks"
        )
    peaks = report.get("peak_memory_mb", {})
    if peaks and all(value is not None for values in peaks.values() for value in values):
        by_stage = report.get("loaded_by_stage")
        where = "each rank loaded only its stage of the blocks" if by_stage else "whole model loaded"
        shown = {phase: " / ".join(f"{value:,.0f}" for value in values) for phase, values in peaks.items()}
        lines.append(
            f"peak memory per rank (MB): loading {shown['loading']}, generating {shown['generating']} ({where})"
        )
    return lines


def guard_line(guard: dict, calibration_s: float) -> str:
    """What the staleness guard did in the last call, and what calibrating it cost (not in the times above)."""
    refreshed = guard["refreshed_steps"]
    steps = ", ".join(map(str, refreshed)) if refreshed else "none"
    line = f"fidelity floor: {len(refreshed)} of {len(guard['moved_db'])} displaced steps refreshed ({steps})"
    if calibration_s:
        line += f"; calibrating it took {format_duration(calibration_s)} (kept for later runs of this size)"
    return line


def json_number(value: float | None) -> float | None:
    """A float JSON can hold: None for a missing or non-finite figure (an identical picture's PSNR is ``inf``)."""
    return value if value is not None and math.isfinite(value) else None


def generate_json(report: dict, job) -> dict:
    """``paradiff generate --json``: one object for the run (the files, seconds, speedup, PSNR, traffic, memory).

    A PSNR of ``inf`` (identical to one device) is written as null beside ``"identical": true``.
    """
    pictures = [
        {**picture, "psnr_db": json_number(picture.get("psnr_db")), "identical": picture.get("psnr_db") == math.inf}
        for picture in report["pictures"]
    ]
    return {
        "files": report["files"],
        "model": job.model,
        "strategy": job.strategy,
        "nproc": job.nproc,
        "steps": job.steps,
        "seconds": report["latency_s"],
        "one_device_seconds": report.get("baseline_s"),
        "speedup": json_number(report.get("speedup")),
        "psnr_db": json_number(report.get("psnr_db")),
        "identical": report.get("psnr_db") == math.inf,
        "bytes_per_step": report.get("bytes_per_step"),
        "wait_s": report.get("wait_s"),
        "peak_memory_mb": report.get("peak_memory_mb"),
        "loaded_by_stage": report.get("loaded_by_stage"),
        "picked": report.get("picked"),
        "fidelity_floor_db": job.fidelity_floor,
        "refreshed_steps": report["guard"]["refreshed_steps"] if "guard" in report else None,
        "calibration_seconds": report.get("calibration_s"),
        "pictures": pictures,
    }
