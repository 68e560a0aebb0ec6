"""TaylorSeer: at the steps between full ones, predict chosen layers' outputs from a Taylor expansion of their
outputs at earlier full steps (diffusers' ``TaylorSeerCacheConfig``).

Its schedule counts each layer's calls per ``cache_context`` and its predictions are elementwise, so every rank that
runs a layer on its part of a call (its tokens, its half of the batch) predicts its part as one device would, at the
same steps: nothing to adapt. Strategies that run a layer several times per step (over pieces of a call) would
count pieces as steps.
"""

from __future__ import annotations

from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook

from .base import StepCache

#: What the counting caches do that a strategy running a call's layers once per piece breaks.
COUNTS_CALLS = "counts each layer's calls as steps, so it needs every layer called once per denoiser call"


class TaylorSeerCache(StepCache):
    name = "TaylorSeerCache"
    hook_classes = (TaylorSeerCacheHook,)
    needs = {"pieces": COUNTS_CALLS}
