"""ParallelConfig: the strategy, what every strategy shares, and the strategy's own options; validated first."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ParadiffError
from .fidelity_floor import check_floor
from .strategies import strategy_class, strategy_names, supported_combinations

#: Options every strategy shares, with their defaults (the fields of :class:`ParallelConfig` but ``options``).
SHARED_OPTIONS = {
    "warmup_steps": 4,
    "cfg_parallel": False,
    "timeout_s": 600.0,
    "parallel_vae": True,
    "device_memory": None,
    "fidelity_floor_db": None,
}


@dataclass(frozen=True, init=False)
class ParallelConfig:
    """How a pipeline is parallelized.

    ``ParallelConfig(strategy="pipefusion", warmup_steps=2, pipefusion_patches=8)``: the shared options
    below, plus the options of the chosen strategy as keywords (its ``Options`` dataclass; reading
    ``config.pipefusion_patches`` works too). An option of another strategy is refused, naming its owner.

    Attributes:
        strategy: ``"patch"`` (displaced patch parallelism, DistriFusion; options ``partial_context``,
            ``bucket_limit_bytes``), ``"pipefusion"`` (displaced patch pipeline parallelism, PipeFusion: each rank
            holds a stage of the DiT's blocks; ``pipefusion_patches``, ``pipefusion_stages``), ``"parastep"`` (step
            parallelism, ParaStep: N ranks compute N consecutive steps at once), ``"asyncdiff"`` (model-component
            parallelism, AsyncDiff: each rank runs one component of the denoiser, a step behind the one before;
            ``asyncdiff_stride``, ``asyncdiff_cut``), ``"cfg"`` (the two halves of the batch, CFG's unconditional
            and conditional ones, on two ranks; exact), ``"ulysses"`` / ``"ring"`` (exact sequence parallelism,
            diffusers' own context parallelism), or any strategy registered with ``paradiff.strategies.register``.
        warmup_steps: the first step and this many more exchange fresh activations (exact); later
            steps reuse the other ranks' activations from the previous step. A value at least the
            number of inference steps reproduces the one-device result. With ``parastep`` these steps
            run on every rank alike; later steps go in rounds, one step per rank.
        cfg_parallel: split every denoiser call's batch into its two CFG halves, run on two groups of
            ranks, and run ``strategy`` within each group (world = 2 × the strategy's degree).
            ``strategy="cfg"`` is this split alone, so it sets ``cfg_parallel`` itself.
        timeout_s: every collective fails after this many seconds instead of hanging.
        parallel_vae: decode the image in row bands on all ranks (exact) instead of whole on each; a VAE decoder
            paradiff cannot band (the video VAEs) runs on rank 0 alone and the others receive its output.
        device_memory: one rank's device memory, in GiB or as a hardware profile's name (``"l40-pcie"``): a
            call whose setting would need more per rank is refused before its denoiser runs, naming the settings
            that fit. ``None`` (default): a CUDA device's total memory; not checked on CPU ranks.
        fidelity_floor_db: a PSNR floor in dB against one device (e.g. 30): a displaced strategy refreshes (runs in
            sync) each step whose stale data moved too far, by a threshold the first call of each shape calibrates
            on the ranks (``paradiff.fidelity_floor``); ``warmup_steps`` then defaults to 0, the guard deciding
            every step after the first. Exact strategies hold any floor. ``None`` (default): no guard.
        options: the strategy's own options (an instance of its ``Options`` dataclass).
    """

    strategy: str
    warmup_steps: int
    cfg_parallel: bool
    timeout_s: float
    parallel_vae: bool
    device_memory: float | str | None
    fidelity_floor_db: float | None
    options: object

    def __init__(self, strategy: str = "patch", **options):
        cls = strategy_class(strategy)
        if "warmup_steps" not in options:
            options["warmup_steps"] = default_warmup(options)
        shared = {name: options.pop(name, default) for name, default in SHARED_OPTIONS.items()}
        _check_owners(strategy, cls, options)
        if cls.cfg_split_alone:
            shared["cfg_parallel"] = True  # the cfg split alone: redundant to ask for it twice
        for name, value in {"strategy": strategy, **shared, "options": cls.Options(**options)}.items():
            object.__setattr__(self, name, value)
        _check_shared(self)

    def __getattr__(self, name: str):
        """The chosen strategy's options read as attributes of the config."""
        options = self.__dict__.get("options")
        if options is not None and name in type(options).names():
            return getattr(options, name)
        raise AttributeError(f"ParallelConfig has no attribute {name!r}")

    def degrees(self, world_size: int) -> tuple[int, int]:
        """``(cfg groups, ranks per group)`` for ``world_size`` ranks, checked before any collective.

        Without ``cfg_parallel``: ``(1, world_size)``. With it: ``(2, world_size // 2)``, the strategy
        running over each group's ranks (one rank: the cfg split alone).
        """
        return strategy_class(self.strategy).degrees(world_size, self)

    def as_options(self) -> dict:
        """The strategy and every option, shared and the strategy's own, by ``parallelize()`` keyword."""
        own = {name: getattr(self.options, name) for name in type(self.options).names()}
        return {"strategy": self.strategy, **{name: getattr(self, name) for name in SHARED_OPTIONS}, **own}

    @classmethod
    def from_options(cls, strategy: str, options: dict) -> ParallelConfig:
        return cls(strategy, **options)


def default_warmup(options: dict) -> int:
    """``warmup_steps`` where ``options`` do not give it: 0 under a fidelity floor (the staleness guard decides every
    step after the first), else :data:`SHARED_OPTIONS`'."""
    return 0 if options.get("fidelity_floor_db") is not None else SHARED_OPTIONS["warmup_steps"]


def _check_owners(strategy: str, cls: type, options: dict) -> None:
    """Refuse options that are not the chosen strategy's, naming the strategy that owns each."""
    foreign = sorted(set(options) - set(cls.Options.names()))
    if not foreign:
        return
    owners = {name: other for other in strategy_names() for name in strategy_class(other).Options.names()}
    unknown = [name for name in foreign if name not in owners]
    if unknown:
        known = sorted({*SHARED_OPTIONS, *owners})
        raise ParadiffError(f"unknown option(s) {unknown} for parallelize(); options: {', '.join(known)}")
    option = foreign[0]
    raise ParadiffError(
        f"{option} is an option of the {owners[option]} strategy, not of strategy='{strategy}'; "
        f"supported: {supported_combinations()}"
    )


def _check_shared(config: ParallelConfig) -> None:
    check_floor(config.fidelity_floor_db)
    cls = strategy_class(config.strategy)
    if config.fidelity_floor_db is not None and cls.uses_warmup and not cls.refreshes:
        guarded = ", ".join(f"'{name}'" for name in strategy_names() if strategy_class(name).refreshes)
        raise ParadiffError(
            f"fidelity_floor_db: strategy='{config.strategy}' cannot refresh a displaced step yet; use one that can "
            f"({guarded}), or a fixed warmup_steps instead of a floor"
        )
    warmup = config.warmup_steps
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ParadiffError(f"warmup_steps must be an integer >= 0, got {warmup!r}")
    if not isinstance(config.cfg_parallel, bool):
        raise ParadiffError(f"cfg_parallel must be True or False, got {config.cfg_parallel!r}")
    if not isinstance(config.timeout_s, (int, float)) or isinstance(config.timeout_s, bool) or config.timeout_s <= 0:
        raise ParadiffError(f"timeout_s must be positive, got {config.timeout_s!r}")
    if not isinstance(config.parallel_vae, bool):
        raise ParadiffError(f"parallel_vae must be True or False, got {config.parallel_vae!r}")
    memory = config.device_memory
    number = isinstance(memory, (int, float)) and not isinstance(memory, bool) and memory > 0
    if memory is not None and not number and not isinstance(memory, str):
        raise ParadiffError(
            f"device_memory must be None, a positive number of GiB or a hardware profile's name, got {memory!r}"
        )


def check_world(strategy: str, world_size: int) -> None:
    """Refuse a world size ``strategy`` cannot run on, as ``parallelize`` would (one rank runs no strategy).

    The ranks ask this before loading anything: it imports the strategy's module, and with it diffusers, which
    a launcher's parent process does not pay for.
    """
    if world_size < 2 or strategy == "auto":
        return
    strategy_class(strategy).degrees(world_size, ParallelConfig(strategy=strategy))
