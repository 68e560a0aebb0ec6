"""Step caches applied by name (``paradiff bench --cache NAME``, the cache benchmark): a diffusers config from the
cache's defaults, what the pipeline tells, and the user's settings.

``first-block``, ``taylorseer``, ``pyramid``, ``faster`` and ``mag`` take the fields of diffusers'
``FirstBlockCacheConfig``, ``TaylorSeerCacheConfig``, ``PyramidAttentionBroadcastConfig``, ``FasterCacheConfig``
and ``MagCacheConfig``. paradiff fills in what a command line cannot give: the timestep callback
PyramidAttentionBroadcast and FasterCache read (the pipeline's ``current_timestep`` where it keeps one, else the
timestep the denoiser was last called with), FasterCache's tensor layout and whether guidance is distilled, and
MagCache's step count. The cache goes onto the denoiser with diffusers' ``apply_*`` function; :func:`remove_cache`
takes it off again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    HookRegistry,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
    apply_faster_cache,
    apply_first_block_cache,
    apply_mag_cache,
    apply_pyramid_attention_broadcast,
    apply_taylorseer_cache,
)
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from torch import nn

from ..compat import invalidate_hook_cache, remove_hook
from ..errors import ParadiffError
from ..loading import makes_video
from ..models import find_denoiser
from . import CACHE_NAMES
from .applied import find_caches

#: Settings that name a torch dtype, given as text ("float32").
_DTYPE_SETTINGS = ("taylor_factors_dtype",)
#: The pipelines MagCache ships magnitude ratios for, by denoiser class.
_SHIPPED_MAG_RATIOS = {"FluxTransformer2DModel": FLUX_MAG_RATIOS}


class CurrentTimestep:
    """The timestep of the step in progress: the pipeline's ``current_timestep`` where it keeps one, else the
    ``timestep`` the denoiser was last called with (seen by a forward pre-hook, removed with the cache)."""

    def __init__(self, pipe, denoiser: nn.Module):
        self.pipe, self.seen = pipe, None
        self.handle = None
        if not hasattr(type(pipe), "current_timestep"):
            self.handle = denoiser.register_forward_pre_hook(self._see, with_kwargs=True)

    def _see(self, module, args, kwargs):
        timestep = kwargs.get("timestep")
        if timestep is None:
            raise ParadiffError(
                f"{type(module).__name__} was called without a timestep= keyword, so the cache cannot read the "
                "timestep its schedule needs; give current_timestep_callback in the cache's settings in Python"
            )
        self.seen = float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)

    def __call__(self) -> float:
        return self.pipe.current_timestep if self.handle is None else self.seen


def _first_block(pipe, denoiser, steps, settings):
    _needs_cache_context("first-block", denoiser)
    return apply_first_block_cache, FirstBlockCacheConfig(**settings)


def _taylorseer(pipe, denoiser, steps, settings):
    _needs_cache_context("taylorseer", denoiser)
    return apply_taylorseer_cache, TaylorSeerCacheConfig(**settings)


def _pyramid(pipe, denoiser, steps, settings):
    settings = {"spatial_attention_block_skip_range": 2, **settings}
    return apply_pyramid_attention_broadcast, PyramidAttentionBroadcastConfig(**settings)


def _faster(pipe, denoiser, steps, settings):
    layout = "BCFHW" if makes_video(pipe) else "BCHW"
    distilled = bool(getattr(denoiser.config, "guidance_embeds", False))
    settings = {"tensor_format": layout, "is_guidance_distilled": distilled, **settings}
    return apply_faster_cache, FasterCacheConfig(**settings)


def _mag(pipe, denoiser, steps, settings):
    shipped = _SHIPPED_MAG_RATIOS.get(type(denoiser).__name__)
    if "mag_ratios" not in settings and not settings.get("calibrate") and shipped is None:
        raise ParadiffError(
            f"MagCache needs magnitude ratios measured for {type(denoiser).__name__}: run once with "
            'mag:{"calibrate": true} on one device and pass the printed list as mag:{"mag_ratios": [...]}'
        )
    defaults = {"num_inference_steps": steps} | ({} if shipped is None else {"mag_ratios": shipped})
    return apply_mag_cache, MagCacheConfig(**(defaults | settings))


def _needs_cache_context(name: str, denoiser: nn.Module) -> None:
    if not hasattr(denoiser, "cache_context"):
        raise ParadiffError(
            f"cache {name!r} keeps its state per named denoiser call (model.cache_context), which "
            f"{type(denoiser).__name__} does not have (no enable_cache); use 'pyramid', 'faster' or 'mag' with it"
        )


#: Each cache's builder of its diffusers config and the function that applies it, by name.
_BUILDERS: dict[str, Callable] = {
    "first-block": _first_block,
    "taylorseer": _taylorseer,
    "pyramid": _pyramid,
    "faster": _faster,
    "mag": _mag,
}
#: The caches whose schedules read the timestep of the step in progress.
_READS_TIMESTEP = ("pyramid", "faster")


def apply_cache(pipe, name: str, steps: int, settings: dict | None = None) -> Callable[[], None]:
    """Put cache ``name`` (one of :data:`~paradiff.caches.CACHE_NAMES`) with ``settings`` on ``pipe``'s denoiser, for
    calls of ``steps`` steps; returns the undo."""
    if name not in CACHE_NAMES:
        raise ParadiffError(f"unknown cache {name!r}; available: {', '.join(CACHE_NAMES)}")
    denoiser = find_denoiser(pipe)
    if find_caches(denoiser):
        raise ParadiffError(f"{type(denoiser).__name__} already has a step cache; remove it first")
    settings = {key: _setting(key, value) for key, value in (settings or {}).items()}
    timestep = None
    if name in _READS_TIMESTEP and "current_timestep_callback" not in settings:
        timestep = CurrentTimestep(pipe, denoiser)
        settings["current_timestep_callback"] = timestep
    try:
        apply, config = _BUILDERS[name](pipe, denoiser, steps, settings)
        apply(denoiser, config)
    except TypeError as error:  # a setting the config does not take
        _forget(timestep)
        raise ParadiffError(f"cache {name!r} does not take these settings: {error}") from error
    except BaseException:
        _forget(timestep)
        raise
    invalidate_hook_cache(denoiser)
    return lambda: remove_cache(pipe, timestep)


def _setting(key: str, value):
    """A setting as the config takes it: a dtype from its name, a timestep range as a tuple (JSON has lists)."""
    if key in _DTYPE_SETTINGS and isinstance(value, str):
        return getattr(torch, value)
    return tuple(value) if isinstance(value, list) and key.endswith("_range") else value


def reset_cache(pipe) -> None:
    """Start the caches on ``pipe``'s denoiser afresh, as diffusers' ``CacheMixin`` pipelines do after each call (the
    others, such as PixArt's, never do)."""
    HookRegistry.check_if_exists_or_initialize(find_denoiser(pipe)).reset_stateful_hooks()


def remove_cache(pipe, timestep: CurrentTimestep | None = None) -> None:
    """Take every step cache's hooks off ``pipe``'s denoiser (and the timestep hook ``apply_cache`` added)."""
    denoiser = find_denoiser(pipe)
    for cache in find_caches(denoiser):
        for found in cache.hooks:
            remove_hook(found.module, found.hook_name)
    invalidate_hook_cache(denoiser)
    _forget(timestep)


def _forget(timestep: CurrentTimestep | None) -> None:
    if timestep is not None and timestep.handle is not None:
        timestep.handle.remove()
