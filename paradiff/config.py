"""ParallelConfig: the strategy and its options, validated before anything is changed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ParadiffError

STRATEGY_NAMES = ("patch", "pipefusion", "parastep", "asyncdiff", "cfg", "ulysses", "ring")

#: What runs together, and on how many ranks; named by every error about a combination.
SUPPORTED_COMBINATIONS = (
    "strategy='patch', 'pipefusion', 'parastep', 'ulysses' or 'ring' (world = its degree), strategy='cfg' "
    "(world = 2), strategy='patch', 'pipefusion', 'parastep', 'ulysses' or 'ring' with cfg_parallel=True "
    "(world = 2 × its degree), strategy='asyncdiff' (world = its components, + 1 with asyncdiff_stride=2)"
)

#: Options that only the pipefusion strategy reads.
_PIPEFUSION_OPTIONS = ("pipefusion_patches", "pipefusion_stages")
#: Options that only the asyncdiff strategy reads, with their defaults.
_ASYNCDIFF_OPTIONS = {"asyncdiff_stride": 1, "asyncdiff_cut": None}


@dataclass(frozen=True)
class ParallelConfig:
    """How a pipeline is parallelized.

    Attributes:
        strategy: ``"patch"`` (displaced patch parallelism, DistriFusion), ``"pipefusion"`` (displaced
            patch pipeline parallelism, PipeFusion: each rank holds a stage of the DiT's blocks),
            ``"parastep"`` (step parallelism, ParaStep: N ranks compute N consecutive steps at once), ``"cfg"``
            (the two halves of the batch, CFG's unconditional and conditional ones, on two ranks; exact),
            or ``"ulysses"`` / ``"ring"`` (exact sequence parallelism, diffusers' own context parallelism).
        warmup_steps: the first step and this many more exchange fresh activations (exact); later
            steps reuse the other ranks' activations from the previous step. A value at least the
            number of inference steps reproduces the one-device result. With ``parastep`` these steps
            run on every rank alike; later steps go in rounds, one step per rank.
        partial_context: PCPP. ``None`` (default): after warm-up every band attends to the whole
            image. A fraction ``p`` in [0, 1]: after warm-up a band attends to itself plus the ``p``
            of each neighbouring band nearest the border, received from its two neighbours only;
            ``0`` means its own band alone.
        pipefusion_patches: PipeFusion. Number M of patches (bands of whole token rows) that flow through the
            pipeline of stages on displaced steps, at least the number of stages. ``None`` (default): the
            divisor of the call's token rows nearest to twice the stages (measured best on CPU: fewer patches
            leave more of each step idle while the pipeline fills and drains, more patches make each
            stage's matrix products too small to run efficiently).
        pipefusion_stages: PipeFusion. Number of transformer blocks of each stage, in block order (one entry
            per rank of the pipeline); ``None`` (default): contiguous stages of about equal measured cost.
        asyncdiff_stride: AsyncDiff. 1: N components on N ranks, one step per parallel round. 2: N components on
            N + 1 ranks, two steps per round (the components run at the next step's timestep while the extra rank
            runs the last component at this step's).
        asyncdiff_cut: AsyncDiff. Number of units (a DiT's blocks; a U-Net's down, mid and up blocks) of each
            component, in forward order; ``None`` (default): contiguous components of about equal measured cost.
        bucket_limit_bytes: on displaced steps, a layer's piece smaller than this is packed with the
            other small pieces into one transfer per denoiser call (few launches); larger pieces are sent
            on their own as soon as they exist (a whole step to arrive behind the compute).
        parallel_vae: decode the image in row bands on all ranks (exact) instead of whole on each.
        timeout_s: every collective fails after this many seconds instead of hanging.
        cfg_parallel: split every denoiser call's batch into its two CFG halves, run on two groups of
            ranks, and run ``strategy`` within each group (world = 2 × the strategy's degree).
            ``strategy="cfg"`` is this split alone, so it sets ``cfg_parallel`` itself.
    """

    strategy: str = "patch"
    warmup_steps: int = 4
    partial_context: float | None = None
    pipefusion_patches: int | None = None
    pipefusion_stages: tuple[int, ...] | None = None
    bucket_limit_bytes: int = 256 * 1024
    parallel_vae: bool = True
    timeout_s: float = 600.0
    cfg_parallel: bool = False
    asyncdiff_stride: int = 1
    asyncdiff_cut: tuple[int, ...] | None = None

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
        if not isinstance(self.cfg_parallel, bool):
            raise ParadiffError(f"cfg_parallel must be True or False, got {self.cfg_parallel!r}")
        if self.pipefusion_patches is not None and (
            not isinstance(self.pipefusion_patches, int) or self.pipefusion_patches < 1
        ):
            raise ParadiffError(f"pipefusion_patches must be None or an integer >= 1, got {self.pipefusion_patches!r}")
        if self.pipefusion_stages is not None:
            stages = self.pipefusion_stages
            if not isinstance(stages, (tuple, list)) or not all(isinstance(n, int) and n >= 1 for n in stages):
                raise ParadiffError(
                    f"pipefusion_stages must be None or the number of blocks of each stage (integers >= 1), "
                    f"got {stages!r}"
                )
            object.__setattr__(self, "pipefusion_stages", tuple(stages))
        if self.strategy != "patch" and self.partial_context is not None:
            raise ParadiffError(
                f"partial_context is an option of the patch strategy and strategy='{self.strategy}' has no row "
                f"bands; supported: {SUPPORTED_COMBINATIONS}"
            )
        self._check_asyncdiff_options()
        for option in _PIPEFUSION_OPTIONS:
            if self.strategy != "pipefusion" and getattr(self, option) is not None:
                raise ParadiffError(
                    f"{option} is an option of the pipefusion strategy, not of strategy='{self.strategy}'; "
                    f"supported: {SUPPORTED_COMBINATIONS}"
                )
        if self.strategy == "cfg":
            object.__setattr__(self, "cfg_parallel", True)  # the cfg split alone: redundant to ask for it twice

    def _check_asyncdiff_options(self) -> None:
        if self.asyncdiff_stride not in (1, 2):
            raise ParadiffError(f"asyncdiff_stride must be 1 or 2, got {self.asyncdiff_stride!r}")
        cut = self.asyncdiff_cut
        if cut is not None:
            if not isinstance(cut, (tuple, list)) or not all(isinstance(n, int) and n >= 1 for n in cut):
                raise ParadiffError(
                    f"asyncdiff_cut must be None or the number of units of each component (integers >= 1), got {cut!r}"
                )
            object.__setattr__(self, "asyncdiff_cut", tuple(cut))
        for option, default in _ASYNCDIFF_OPTIONS.items():
            if self.strategy != "asyncdiff" and getattr(self, option) != default:
                raise ParadiffError(
                    f"{option} is an option of the asyncdiff strategy, not of strategy='{self.strategy}'; "
                    f"supported: {SUPPORTED_COMBINATIONS}"
                )

    def degrees(self, world_size: int) -> tuple[int, int]:
        """``(cfg groups, ranks per group)`` for ``world_size`` ranks, checked before any collective.

        Without ``cfg_parallel``: ``(1, world_size)``. With it: ``(2, world_size // 2)``, the strategy
        running over each group's ranks (one rank: the cfg split alone).
        """
        cfg, degree = self._mesh(world_size)
        if self.strategy == "pipefusion":
            self._check_pipeline(degree)
        return cfg, degree

    def _mesh(self, world_size: int) -> tuple[int, int]:
        if not self.cfg_parallel:
            return 1, world_size
        if world_size % 2:
            even = " or ".join(str(n) for n in (world_size - 1, world_size + 1) if n >= 2)
            raise ParadiffError(
                f"cfg_parallel needs an even world size, got {world_size}: the two CFG halves run on two equal "
                f"groups of ranks; launch {even} ranks (supported: {SUPPORTED_COMBINATIONS})"
            )
        if self.strategy == "cfg" and world_size != 2:
            raise ParadiffError(
                f"strategy='cfg' runs the two CFG halves on 2 ranks, got a world of {world_size}; launch 2 ranks, "
                f"or use strategy='patch' with cfg_parallel=True to run patch on {world_size // 2} ranks per half "
                f"(supported: {SUPPORTED_COMBINATIONS})"
            )
        return 2, world_size // 2

    def _check_pipeline(self, stages: int) -> None:
        per_half = " per CFG half" if self.cfg_parallel else ""
        if self.pipefusion_patches is not None and self.pipefusion_patches < stages:
            raise ParadiffError(
                f"pipefusion_patches={self.pipefusion_patches} is fewer than the {stages} pipeline stages (one per "
                f"rank{per_half}): some stages would never work; use pipefusion_patches >= {stages}, or None for "
                "the default"
            )
        if self.pipefusion_stages is not None and len(self.pipefusion_stages) != stages:
            raise ParadiffError(
                f"pipefusion_stages={list(self.pipefusion_stages)} gives {len(self.pipefusion_stages)} stages, but the "
                f"pipeline has {stages} (one per rank{per_half}); give one block count per stage"
            )

    @classmethod
    def from_options(cls, strategy: str, options: dict) -> ParallelConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"strategy"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ParadiffError(f"unknown option(s) {unknown} for parallelize(); options: {', '.join(sorted(known))}")
        return cls(strategy=strategy, **options)
