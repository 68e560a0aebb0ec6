"""How long a pipeline's calls take at the least, said before a run the user would not sit through unwarned.

The denoiser's FLOPs per call come from the planner's meta trace at the call's own size (no weights read, no
picture drawn); the machine's rate from a timed matrix product, which no denoiser call beats. The figure is
therefore a lower bound, reached by nothing but the denoiser's arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .calibrate import fastest
from .workload import pipeline_workload

#: The side of the square matrices timed for the machine's rate: large enough to run at full speed.
MATMUL_SIDE = 1024


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """This machine's rate on one dense matrix product, the fastest work a denoiser call does (FLOP/s)."""
    a = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device).to(dtype)
    seconds = fastest(lambda: a @ a, device)
    return 2 * MATMUL_SIDE**3 / max(seconds, 1e-9)


def denoising_seconds_at_least(
    pipe, call: Callable[[], object], steps: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, float]:
    """The least seconds ``steps`` steps of the calls ``call()`` (one call of ``pipe``) make take on ``device``
    in ``dtype``, and the FLOPs of one denoiser call; ``call`` runs only up to its first denoiser call."""
    workload, _ = pipeline_workload(pipe, call, dtype)
    flops_per_step = workload.flops * workload.calls_per_step
    return flops_per_step * steps / matmul_flops_per_s(device, dtype), workload.flops
