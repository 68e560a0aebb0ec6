"""Step caches a user applied to the denoiser (diffusers' FirstBlockCache, TaylorSeer, ...) under every strategy.

A step cache skips work at some steps (whole blocks, attention layers, the unconditional half of the batch) and
reuses or predicts it from earlier steps, deciding by a schedule (a count of calls) or a measure of the activations.
Under a strategy every rank must take each of those decisions alike, and as one device would: ranks that decide
apart run different collectives (a gloo abort, or a hang until the timeout) or silently draw another image.

:mod:`.applied` finds, checks and adapts the caches on a denoiser; one module per cache declares what it needs
(:mod:`.first_block`, :mod:`.taylorseer`, :mod:`.pyramid`, :mod:`.faster`, :mod:`.mag`); :mod:`.presets` applies
a cache by name. This module imports nothing heavy, so the command line checks ``--cache`` before any worker starts.
"""

from __future__ import annotations

import json

from ..errors import ParadiffError

#: The caches ``paradiff bench --cache`` and :func:`paradiff.caches.presets.apply_cache` take, by name.
CACHE_NAMES = ("first-block", "taylorseer", "pyramid", "faster", "mag")


def parse_cache(text: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:{json settings}`` (``first-block:{"threshold": 0.1}``) as ``(name, settings)``."""
    name, _, settings = text.partition(":")
    if name not in CACHE_NAMES:
        raise ParadiffError(f"unknown cache {name!r}; available: {', '.join(CACHE_NAMES)}")
    if not settings:
        return name, {}
    try:
        values = json.loads(settings)
    except json.JSONDecodeError as error:
        raise ParadiffError(f"the settings of cache {name!r} are not JSON: {settings!r} ({error})") from error
    if not isinstance(values, dict):
        raise ParadiffError(f'the settings of cache {name!r} must be a JSON object, like {name}:{{"threshold": 0.1}}')
    return name, values
