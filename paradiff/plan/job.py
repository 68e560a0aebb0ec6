"""A plan: every strategy and warm-up predicted for one model, size, step count and number of ranks.

A model ``paradiff generate`` can load is traced from its pipeline's own call and, without ``--hardware``,
timed here on the ranks the plan is for (:mod:`paradiff.plan.calibrate`). An architecture name
(:mod:`paradiff.plan.architectures`) has no weights: it needs a hardware profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import check_on_denoiser
from ..config import ParallelConfig
from ..errors import ParadiffError
from ..models import family_of
from ..models.base import bind_inputs
from ..strategies import strategy_class
from .architectures import architecture
from .costs import Fixed, Prediction, always_exact, decode_fixed, modelled, modelled_strategies, no_cost_model, predict
from .forcing_loop import BlockLoop
from .hardware import Hardware, hardware_names, hardware_profile
from .workload import Workload, meta_model, trace

#: The prompt a plan traces and times the model with (the built-in models know its words).
PLAN_PROMPT = "a large red circle on the left on a white background"


@dataclass(frozen=True)
class PlanJob:
    model: str
    nproc: int
    steps: int
    size: int | None = None
    frames: int | None = None
    strategies: tuple[str, ...] | None = None
    warmups: tuple[int, ...] = (4,)
    hardware: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 1
    allow_pickle: bool = False
    #: More arguments of the pipeline's call (``--call``), as ``(key, value)`` pairs.
    call: tuple = ()
    #: Width in pixels when it differs from ``size`` (the height).
    width: int | None = None
    #: The longest a collective waits for another rank (``--timeout``).
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Plan:
    model: str
    size: int
    frames: int | None
    steps: int
    nproc: int
    dtype: str
    hardware: Hardware
    workload: Workload
    fixed: Fixed
    predictions: tuple[Prediction, ...]
    #: Strategy -> why it cannot run this model at this size on these ranks.
    refused: dict = field(default_factory=dict)
    #: A diffusion-forcing pipeline's loop (its iterations, not ``steps``, are what the predictions count).
    blocks: BlockLoop | None = None
    #: Width in pixels (None: ``size``, square).
    width: int | None = None
    #: What was asked (the command lines the report prints repeat its options); None: not from a job.
    job: PlanJob | None = None

    @property
    def pixels(self) -> str:
        return f"{self.size} px" if self.width in (None, self.size) else f"{self.size}×{self.width} px"

    @property
    def iterations(self) -> int:
        """Denoiser iterations of the pipeline's loop: its steps, or a diffusion-forcing schedule's iterations."""
        return self.blocks.iterations if self.blocks is not None else self.steps

    def best(self, exact: bool = True) -> Prediction | None:
        """The fastest predicted setting that fits in a rank's memory (among the exact ones with ``exact``); None if
        none runs."""
        candidates = [p for p in self.predictions if p.fits and (p.exact or not exact)]
        return max(candidates, key=lambda p: p.predicted_speedup, default=None)

    def unfit(self) -> str | None:
        """The settings whose memory per rank exceeds a device's, and those that fit; None when all fit."""
        unfit = {p.label: p.memory_mb for p in self.predictions if not p.fits}
        if not unfit:
            return None
        fitting = ", ".join(dict.fromkeys(p.label for p in self.predictions if p.fits))
        needs = ", ".join(f"{label} ({mb:,.0f} MB)" for label, mb in unfit.items())
        memory = self.hardware.memory_bytes / 2**20
        fits = f"fits: {fitting}" if fitting else "nothing fits: use more ranks or a smaller size"
        return f"{needs} need more than a device's {memory:,.0f} MB per rank; {fits}"


def predictions(
    workload: Workload,
    hardware: Hardware,
    dtype: str,
    job: PlanJob,
    runnable: dict,
    fixed: Fixed,
    blocks: BlockLoop | None = None,
) -> tuple[Prediction, ...]:
    """Every runnable strategy setting × warm-up (exact strategies once): with the CFG split on 4+ even ranks, and
    ``asyncdiff`` at stride 2 on 3+ ranks."""
    rows = []
    for strategy, settings in runnable.items():
        warmups = (0,) if always_exact(strategy) else job.warmups
        for cfg_parallel, options in settings:
            for warmup in warmups:
                rows.append(
                    predict(
                        workload,
                        hardware,
                        dtype,
                        strategy,
                        job.nproc,
                        job.steps,
                        warmup,
                        cfg_parallel,
                        fixed,
                        blocks=blocks,
                        **dict(options),
                    )
                )
    return tuple(rows)


def _candidates(job: PlanJob) -> tuple[str, ...]:
    names = job.strategies or modelled_strategies()
    unknown = [name for name in names if not modelled(name)]
    if unknown:
        raise ParadiffError(no_cost_model(unknown[0]))
    return names


def runnable_strategies(check, job: PlanJob, cfg_batch: bool) -> tuple[dict, dict]:
    """``(strategy -> its settings that run, strategy -> why not)``; a setting is ``(cfg_parallel, options)``, and
    ``check(strategy, cfg_parallel=..., **options)`` raises the ParadiffError ``parallelize`` would."""
    runnable, refused = {}, {}
    for strategy in _candidates(job):
        tried = [(False, ()), (True, ())]
        variants = strategy_class(strategy).plan_variants
        for options, least, *split in variants:
            if job.nproc >= least:
                tried += [(False, options)] + ([(True, options)] if any(split) else [])
        settings = []
        for cfg_parallel, options in tried:
            alone = strategy_class(strategy).cfg_split_alone
            if cfg_parallel and (alone or job.nproc < 4 or job.nproc % 2 or not cfg_batch):
                continue
            try:
                check(strategy, cfg_parallel=cfg_parallel, **dict(options))
                settings.append((cfg_parallel, options))
            except ParadiffError as error:
                if not cfg_parallel and not options:
                    refused[strategy] = str(error)
        if strategy_class(strategy).cfg_split_alone and not cfg_batch:
            settings, refused[strategy] = [], "the pipeline runs no classifier-free guidance at this setting"
        if settings:
            runnable[strategy] = tuple(settings)
    return runnable, refused


def plan_architecture(job: PlanJob) -> Plan:
    """A plan for a well-known denoiser by name, from its public config and a hardware profile."""

    arch = architecture(job.model)
    if job.hardware is None:
        raise ParadiffError(
            f"{job.model} is an architecture without weights, so this machine cannot time it; pass --hardware "
            f"({', '.join(hardware_names())})"
        )
    hardware = hardware_profile(job.hardware)
    size = job.size or arch.default_size
    dims = arch.dims(size, job.frames, job.width)
    model = meta_model(arch.model_class(), arch.spec["config"], arch.dtype)
    workload = trace(model, (), arch.inputs(dims), arch.token_rows(dims), arch.calls_per_step)
    family = family_of(model, any_model=True)

    def check(strategy: str, cfg_parallel: bool, **options) -> None:
        """What ``check_parallelize`` checks of the denoiser alone: its family, its blocks, the size's rows."""
        cls = strategy_class(strategy)
        if not cls.supports(family):
            raise ParadiffError(f"strategy={strategy!r} does not run {type(model).__name__}")
        split = strategy_class(strategy).split_options(cfg_parallel)
        config = ParallelConfig.from_options(strategy, {**split, **options})
        _, degree = config.degrees(job.nproc)
        check_on_denoiser(model, family, config, degree, size, arch.spec["vae_scale_factor"], this_machine=False)

    cfg_batch = _batch(model, family, arch.inputs(dims)) % 2 == 0 or arch.calls_per_step == 2
    runnable, refused = runnable_strategies(check, job, cfg_batch)
    dtype = arch.spec["dtype"]
    frames = None if arch.default_frames is None else job.frames or arch.default_frames
    fixed = decode_fixed(arch.decode_cost(dims), hardware)  # paradiff bands the decode over the ranks
    rows = predictions(workload, hardware, dtype, job, runnable, fixed)
    return Plan(
        job.model,
        size,
        frames,
        job.steps,
        job.nproc,
        dtype,
        hardware,
        workload,
        fixed,
        rows,
        refused,
        width=job.width,
        job=job,
    )


def _batch(model, family, inputs: dict) -> int:

    return bind_inputs(model, (), inputs).arguments[family.latent_arg].shape[0]
