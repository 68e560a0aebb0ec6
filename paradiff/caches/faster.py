"""FasterCache: reuse attention outputs at some steps, and at some steps compute only the conditional half of the
CFG batch, the unconditional half approximated from it in frequency space (diffusers' ``FasterCacheConfig``).

Its denoiser hook splits the whole batch into its halves and the whole output into frequencies (a 2-D FFT over
the image), so under a strategy that cuts each call's tokens it is moved outermost on the denoiser, outside the
strategy's cut: it sees whole calls, as on one device, and the strategy runs the calls it makes (the conditional
half alone, at its skipping steps). Elsewhere (``parastep``) it stays inside the strategy's hook, which then
reuses whole calls, the cache's included. Its attention hooks work per token and sample.
"""

from __future__ import annotations

from diffusers.hooks.faster_cache import FasterCacheBlockHook, FasterCacheDenoiserHook

from .base import CallShares, StepCache, move_outermost
from .taylorseer import COUNTS_CALLS

#: What FasterCache does that a strategy running the blocks on different ranks, a step apart, breaks.
BATCH_BETWEEN_STEPS = (
    "leaves the unconditional half out of the batch at some steps, and activations passed between ranks a step "
    "later must keep their batch"
)


class FasterCache(StepCache):
    name = "FasterCache"
    hook_classes = (FasterCacheDenoiserHook, FasterCacheBlockHook)
    needs = {
        "batch": "approximates the unconditional half of each call's batch from its conditional half, so it needs "
        "both halves on one rank",
        "blocks": BATCH_BETWEEN_STEPS,
        "pieces": COUNTS_CALLS,
    }

    def adapt(self, installed, shares: CallShares) -> None:
        super().adapt(installed, shares)
        if shares.tokens is None:
            return
        for found in self.hooks:
            if found.module is installed.model:  # its denoiser hook must see whole calls
                move_outermost(found)
