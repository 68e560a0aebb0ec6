"""ParallelConfig: the strategy and its options, validated before anything is changed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ParadiffError

STRATEGY_NAMES = ("patch",)


@dataclass(frozen=True)
class ParallelConfig:
    """How a pipeline is parallelized.

    Attributes:
        strategy: ``"patch"`` (displaced patch parallelism, DistriFusion).
        warmup_steps: the first step and this many more exchange fresh activations (exact); later
            steps reuse the other ranks' activations from the previous step. A value at least the
            number of inference steps reproduces the one-device result.
        partial_context: PCPP. ``None`` (default): after warm-up every band attends to the whole
            image. A fraction ``p`` in [0, 1]: after warm-up a band attends to itself plus the ``p``
            of each neighbouring band nearest the border, received from its two neighbours only;
            ``0`` means its own band alone.
        bucket_limit_bytes: on displaced steps, a layer's piece smaller than this is packed with the
            other small pieces into one transfer per denoiser call (few launches); larger pieces are sent
            on their own as soon as they exist (a whole step to arrive behind the compute).
        parallel_vae: decode the image in row bands on all ranks (exact) instead of whole on each.
        timeout_s: every collective fails after this many seconds instead of hanging.
    """

    strategy: str = "patch"
    warmup_steps: int = 4
    partial_context: float | None = None
    bucket_limit_bytes: int = 256 * 1024
    parallel_vae: bool = True
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.strategy not in STRATEGY_NAMES:
            raise ParadiffError(f"unknown strategy {self.strategy!r}; available: {', '.join(STRATEGY_NAMES)}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ParadiffError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.partial_context is not None and not 0.0 <= self.partial_context <= 1.0:
            raise ParadiffError(f"partial_context must be None or within [0, 1], got {self.partial_context!r}")
        if self.bucket_limit_bytes < 0:
            raise ParadiffError(f"bucket_limit_bytes must be >= 0, got {self.bucket_limit_bytes!r}")
        if self.timeout_s <= 0:
            raise ParadiffError(f"timeout_s must be positive, got {self.timeout_s!r}")

    @classmethod
    def from_options(cls, strategy: str, options: dict) -> ParallelConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"strategy"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ParadiffError(f"unknown option(s) {unknown} for parallelize(); options: {', '.join(sorted(known))}")
        return cls(strategy=strategy, **options)
