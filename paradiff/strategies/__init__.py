"""The registry of strategies: one line per built-in strategy, and :func:`register` for any other.

Every strategy implements :class:`paradiff.strategies.base.Strategy` in a module of its own. Built-in
modules are imported on first use (they import diffusers), so ``import paradiff`` and the CLI's
argument checks stay fast.
"""

from __future__ import annotations

import importlib

from ..errors import ParadiffError

#: Built-in strategies: name → ``module:class``, in the order messages list them.
_BUILTIN = {
    "patch": "paradiff.strategies.patch:PatchStrategy",
    "pipefusion": "paradiff.strategies.pipefusion:PipeFusionStrategy",
    "parastep": "paradiff.strategies.parastep:ParaStepStrategy",
    "asyncdiff": "paradiff.strategies.asyncdiff:AsyncDiffStrategy",
    "cfg": "paradiff.strategies.cfg:CfgStrategy",
    "ulysses": "paradiff.strategies.sequence:UlyssesStrategy",
    "ring": "paradiff.strategies.sequence:RingStrategy",
    "dualparal": "paradiff.strategies.dualparal:DualParalStrategy",
}
_REGISTERED: dict[str, type] = {}
#: The names of the strategies that come with paradiff.
BUILTIN_NAMES = tuple(_BUILTIN)


def register(strategy: type) -> type:
    """Make ``strategy`` (a :class:`~paradiff.strategies.base.Strategy` subclass) available by its ``name``.

    Call it on every rank before ``parallelize``; usable as a class decorator.
    """
    name = getattr(strategy, "name", "")
    if not name:
        raise ParadiffError(f"{strategy.__name__} has no name; set the class attribute name = '...'")
    if name in _BUILTIN and _BUILTIN[name] != f"{strategy.__module__}:{strategy.__qualname__}":
        raise ParadiffError(f"strategy name {name!r} is taken by a built-in strategy; choose another name")
    _REGISTERED[name] = strategy
    return strategy


def unregister(name: str) -> None:
    """Forget a strategy :func:`register` made available (the built-in ones stay)."""
    if name in _BUILTIN:
        raise ParadiffError(f"strategy {name!r} is built in and cannot be unregistered")
    _REGISTERED.pop(name, None)


def strategy_names() -> tuple[str, ...]:
    """Every strategy's name: the built-in ones, then the registered ones."""
    return (*_BUILTIN, *(name for name in _REGISTERED if name not in _BUILTIN))


def strategy_class(name: str) -> type:
    """The strategy called ``name``; raises naming the available ones."""
    if name not in _REGISTERED:
        if name not in _BUILTIN:
            raise ParadiffError(f"unknown strategy {name!r}; available: {', '.join(strategy_names())}")
        module, _, cls = _BUILTIN[name].partition(":")
        _REGISTERED[name] = getattr(importlib.import_module(module), cls)
    return _REGISTERED[name]


def supported_combinations() -> str:
    """What runs together and on how many ranks; named by every error about a combination."""
    by_world: dict[str, list[str]] = {}
    for name in strategy_names():
        by_world.setdefault(strategy_class(name).world, []).append(f"'{name}'")
    alone = [f"{listed(names)} ({world})" for world, names in by_world.items()]
    paired = [f"'{name}'" for name in strategy_names() if not strategy_class(name).cfg_split_alone]
    return f"strategy={', '.join(alone)}; {listed(paired)} with cfg_parallel=True (world = 2 × theirs)"


def listed(names: list[str]) -> str:
    """``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
