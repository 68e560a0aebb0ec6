"""What the benchmark scripts share: a timed call of a bench-size pipeline, and each pipeline built once per process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

# The multi-rank harness (RankPool) is a development tool that lives with the tests, not in the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from paradiff.tiny import build_pipeline, prompt_inputs

_PIPES: dict = {}


def generate(pipe, family: str, size: int, steps: int, **extra):
    """``(images, seconds)`` of one call with the family's prompt inputs, seed 0 and ``extra`` arguments."""
    start = time.perf_counter()
    images = pipe(
        **prompt_inputs(pipe, family),
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **extra,
    ).images
    return images, time.perf_counter() - start


def status_mb(field: str) -> float:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MB (Linux)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1]) / 1024


def cached_pipeline(family: str):
    """The family's bench-size pipeline (``paradiff.tiny``), built on first use and called once untimed."""
    if family not in _PIPES:
        _PIPES[family] = build_pipeline(family, size="bench")
        generate(_PIPES[family], family, 64, 1)  # first-call allocations out of the timed runs
    return _PIPES[family]


def concurrently(family: str, size: int, steps: int) -> float:
    """Seconds of the one-device job (no paradiff) on this rank while every other rank runs it too: how much the
    ranks slow each other, the host ceiling of a multi-rank benchmark. The pipeline is built before the ranks
    start together."""
    import torch.distributed as dist

    pipe = cached_pipeline(family)
    dist.barrier()
    return generate(pipe, family, size, steps)[1]
