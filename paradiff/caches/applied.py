"""The step caches on a denoiser: found by their hooks, checked against a strategy, compared and adapted.

``find_caches`` reads the hook registries of the denoiser and its modules (``enable_cache(config)`` and diffusers'
``apply_*`` functions put a cache's hooks there) and knows each cache by its hook classes. ``check_caches`` refuses,
in ``check_parallelize`` (before any collective, every rank alike), a cache that cannot run under the strategy,
naming both and the strategies that do run it; ``describe_caches`` is what the ranks compare at ``parallelize``;
``adapt_caches`` changes the others' hooks on this model instance only, through diffusers' hooks and per-instance
attributes (one module per cache says how). A stateful hook paradiff does not know is refused: it cannot tell how
that hook decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..compat import applied_cache_config, hook_registries
from ..errors import ParadiffError
from ..runtime.consensus import describe
from ..strategies import listed, strategy_class, strategy_names
from ..strategies.installation import Installation
from .base import CallShares, FoundHook, SecondCallRefusal, StepCache
from .faster import FasterCache
from .first_block import FirstBlockCache
from .mag import MagCache
from .pyramid import PyramidAttentionBroadcast
from .taylorseer import TaylorSeerCache

if TYPE_CHECKING:
    from ..config import ParallelConfig
    from ..runtime.comm import Communicator

#: The caches paradiff runs under its strategies, in the order messages and docs list them.
CACHES: tuple[type[StepCache], ...] = (
    FirstBlockCache,
    TaylorSeerCache,
    PyramidAttentionBroadcast,
    FasterCache,
    MagCache,
)

#: What a strategy does to a denoiser call, by its ``call_split``, as refusals say it.
SPLIT_WORDS = {
    "tokens": "cuts every call's tokens over the ranks",
    "batch": "runs the two halves of each call's CFG batch on different ranks",
    "whole": "runs whole calls on each rank",
    "blocks": "runs the denoiser's blocks on different ranks, each a step behind the one before after warm-up",
    "pieces": "runs each denoiser call in pieces through stages of blocks held by different ranks",
    None: "does not declare how it splits a denoiser call",
}


class UnknownCache(StepCache):
    """A stateful hook paradiff does not know (another cache, or a user's own): refused under every strategy."""

    def __init__(self, hooks: list[FoundHook]):
        super().__init__(hooks)
        self.name = type(hooks[0].hook).__name__

    def refusal(self, split: str | None) -> str:
        return (
            f"keeps state across steps (a stateful diffusers hook, '{self.hooks[0].hook_name}' on "
            f"{self.hooks[0].module_name or 'the denoiser'}) in a way paradiff does not know, so it cannot make every "
            "rank decide alike"
        )


def find_caches(denoiser: nn.Module) -> list[StepCache]:
    """The step caches whose hooks are on ``denoiser`` or its modules: known kinds first, then unknown ones."""
    found: dict[type[StepCache], list[FoundHook]] = {}
    unknown: dict[type, list[FoundHook]] = {}
    for module_name, module, registry in hook_registries(denoiser):
        for hook_name, hook in registry.hooks.items():
            if hook_name.startswith("paradiff."):
                continue
            record = FoundHook(module_name, module, hook_name, hook)
            kind = next((cache for cache in CACHES if isinstance(hook, cache.hook_classes)), None)
            if kind is not None:
                found.setdefault(kind, []).append(record)
            elif getattr(hook, "_is_stateful", False):
                unknown.setdefault(type(hook), []).append(record)
    return [kind(hooks) for kind, hooks in found.items()] + [UnknownCache(hooks) for hooks in unknown.values()]


def check_caches(denoiser: nn.Module, config: ParallelConfig, cfg_split: bool, degree: int) -> None:
    """Refuse a cache on ``denoiser`` that cannot run under ``config``'s strategy (on ``degree`` ranks per CFG group)
    or under its CFG split; no collective, no change."""
    strategy = strategy_class(config.strategy) if degree > 1 else None
    for cache in find_caches(denoiser):
        if cfg_split and cache.refusal("batch"):
            where = "strategy='cfg'" if strategy is None else "cfg_parallel=True"
            raise ParadiffError(_refusal(cache, where, "the CFG split", "batch"))
        if strategy is not None and cache.refusal(strategy.call_split):
            where = f"strategy='{strategy.name}'"
            raise ParadiffError(_refusal(cache, where, where, strategy.call_split))


def _refusal(cache: StepCache, where: str, who: str, split: str | None) -> str:
    return (
        f"{cache.name} cannot run under {where}: the cache {cache.refusal(split)}, and {who} {SPLIT_WORDS[split]}; "
        f"{_alternatives(cache)}"
    )


def _alternatives(cache: StepCache) -> str:
    hosts = [
        f"'{name}'"
        for name in strategy_names()
        if strategy_class(name).call_split is not None and not cache.refusal(strategy_class(name).call_split)
    ]
    if not hosts or isinstance(cache, UnknownCache):
        return "run without the cache (denoiser.disable_cache(), or a pipeline built without it)"
    return f"strategy={listed(hosts)} run it, or run without the cache"


def check_auto(denoiser: nn.Module) -> None:
    """Refuse ``strategy="auto"`` on a denoiser with a step cache: it plans by timing the denoiser's calls alone,
    outside any step of the pipeline's loop, which a cache would skip through (or refuse: no ``cache_context``)."""
    for cache in find_caches(denoiser):
        raise ParadiffError(
            f"strategy='auto' plans by timing the denoiser's calls outside the pipeline's steps, which {cache.name} "
            f"on it would skip through; choose the strategy yourself: {_alternatives(cache)}"
        )


def describe_caches(denoiser: nn.Module) -> str:
    """The caches on ``denoiser`` and the config ``enable_cache`` applied, for the ranks to compare."""
    caches = [cache.describe() for cache in find_caches(denoiser)]
    config = applied_cache_config(denoiser)
    if config is not None:
        fields = getattr(config, "__dataclass_fields__", {})
        caches.append(f"{type(config).__name__}({describe({name: getattr(config, name) for name in fields})})")
    return "; ".join(caches) or "none"


def two_call_message(cache: StepCache) -> str:
    hosts = [f"'{name}'" for name in strategy_names() if strategy_class(name).call_split in ("tokens", "whole")]
    return (
        f"{cache.name} cannot run under the CFG split of this pipeline's two-call guidance (a conditional and an "
        f"unconditional call per step, one per group of ranks): the cache {cache.two_call_split}, and the split runs "
        f"the two calls on different ranks; use strategy={listed(hosts)} without cfg_parallel, or run without the cache"
    )


def adapt_caches(denoiser: nn.Module, tokens: Communicator | None, cfg: Communicator | None) -> Installation | None:
    """Adapt the caches on ``denoiser`` to the ranks of a parallel run: ``tokens`` is the strategy's group when it
    cuts every call's tokens, ``cfg`` the CFG split's group. Returns what undoes it (None: no cache)."""
    caches = find_caches(denoiser)
    if not caches:
        return None
    installed = Installation(denoiser, "caches")
    shares = CallShares(tokens, cfg)
    for cache in caches:
        cache.adapt(installed, shares)
        if cache.two_call_split and cfg is not None:
            installed.hook(cache.hooks[0].module, SecondCallRefusal(cfg.state, two_call_message(cache)))
    return installed.done()
