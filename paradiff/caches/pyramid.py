"""PyramidAttentionBroadcast: reuse an attention layer's last output at all but every N-th call within a range of
timesteps (diffusers' ``PyramidAttentionBroadcastConfig``).

Its schedule counts the layer's calls, whatever their ``cache_context``, and its reuse is per token and sample, so
every rank that runs a layer on its part of a call reuses its part as one device would. With two-call guidance
(Flux's true CFG) one device counts both of a step's calls and can reuse the first call's attention output in the
second; the CFG split runs the two calls on different ranks, so that pairing is refused at its first step.
"""

from __future__ import annotations

from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastHook

from .base import StepCache
from .taylorseer import COUNTS_CALLS


class PyramidAttentionBroadcast(StepCache):
    name = "PyramidAttentionBroadcast"
    hook_classes = (PyramidAttentionBroadcastHook,)
    needs = {"pieces": COUNTS_CALLS}
    two_call_split = (
        "keeps one count of calls and one cached output per attention layer for both calls of a step, so on one "
        "device a step's second call can reuse the first call's attention output"
    )
