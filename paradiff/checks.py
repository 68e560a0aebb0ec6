"""What ``parallelize`` would refuse, asked without changing the pipeline or making any collective.

Launchers (the CLI, the planner) call these before drawing anything, so bad input costs no compute; the
planner asks :func:`check_on_denoiser` of a denoiser built on the meta device for a machine it only models.
"""

from __future__ import annotations

from torch import nn

from .caches.applied import check_caches
from .config import ParallelConfig
from .errors import ParadiffError
from .models import family_of, find_denoiser
from .runtime.distributed import env_world_size
from .stages.load_stage import check_loaded_stage
from .strategies import strategy_class
from .strategies.cfg import CfgStrategy
from .strategies.support import strategies_for


def vae_scale_factor(pipe) -> int:
    """Pixels per latent row: the pipeline's own ``vae_scale_factor`` (8 when it has none)."""
    return int(getattr(pipe, "vae_scale_factor", 8))


def check_parallelize(
    pipe,
    strategy: str = "patch",
    world_size: int | None = None,
    height: int | None = None,
    config: ParallelConfig | None = None,
    **options,
) -> None:
    """Raise the :class:`ParadiffError` that ``parallelize`` (and a call at ``height`` pixels) would raise on
    ``world_size`` ranks (default: the current world), without any collective or any change to ``pipe``.

    Everything paradiff can refuse before work starts is checked here: the options, the world size, the
    strategy against the denoiser and the pipeline, the height against the strategy's cut, and the step caches
    on the denoiser against the strategy. A launcher
    calls it before drawing anything, so bad input costs no compute.
    """
    config = config or ParallelConfig.from_options(strategy, options)
    denoiser = find_denoiser(pipe)
    strategy_cls = strategy_class(config.strategy)
    family = family_of(denoiser, any_model=strategy_cls.model_agnostic)  # the CFG split is model-agnostic too
    world_size = env_world_size() if world_size is None else world_size
    check_loaded_stage(denoiser, config, world_size)
    if world_size == 1:
        return
    cfg, degree = config.degrees(world_size)
    if height:
        _check_model_height(denoiser, family, height, vae_scale_factor(pipe))
    if cfg > 1:
        CfgStrategy.check_pipeline(pipe, denoiser, strategies_for(family, cfg_split=False))
    check_on_denoiser(denoiser, family, config, degree, height, vae_scale_factor(pipe))
    check_caches(denoiser, config, cfg > 1, degree)


def check_on_denoiser(
    denoiser: nn.Module,
    family,
    config: ParallelConfig,
    degree: int,
    height: int | None,
    vae_scale_factor: int,
    this_machine: bool = True,
) -> None:
    """The checks of :func:`check_parallelize` that need the denoiser alone: the model, this machine (unless
    ``this_machine`` is False: a plan for another one) and the height, against the strategy on ``degree`` ranks."""
    if degree == 1:  # the cfg split alone: the strategy does not run
        return
    strategy_cls = strategy_class(config.strategy)
    strategy_cls.check_model(denoiser, family, degree, config)
    if this_machine:
        strategy_cls.check_machine(denoiser)
    if height:
        strategy_cls(config.options).check_height(denoiser, degree, height, vae_scale_factor)


def _check_model_height(denoiser: nn.Module, family, height: int, vae_scale_factor: int) -> None:
    """Refuse a height the denoiser itself cannot draw: not whole rows of its latent patches."""
    pixels = family.pixels_per_row(denoiser, vae_scale_factor)
    if height % pixels:
        lower, upper = height - height % pixels, height - height % pixels + pixels
        near = f"{lower} or {upper}" if lower else str(upper)
        raise ParadiffError(
            f"height {height} is not a multiple of {pixels} pixels (a row of {type(denoiser).__name__}'s latent "
            f"patches), so the model cannot draw it; use {near}"
        )
