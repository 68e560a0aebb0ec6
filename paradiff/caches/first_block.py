"""FirstBlockCache: after the first block, skip every later block when its residual changed little since the last
computed step (diffusers' ``FirstBlockCacheConfig``).

Its measure is the mean absolute change of the first block's residual over its mean magnitude. Where a call's tokens
or batch lie in parts on several ranks, both are summed over those ranks (one small all-gather per call) and every rank
takes the one-device decision; each rank deciding from its own part would run the later blocks, and their
collectives, where another skips them.
"""

from __future__ import annotations

import torch
from diffusers.hooks.first_block_cache import FBCBlockHook, FBCHeadBlockHook

from ..compat import first_block_decision, replace_first_block_decision
from ..runtime.shared_measure import SharedMeasure
from .base import CallShares, StepCache

#: What FirstBlockCache and MagCache do that a strategy cutting a call's blocks over the ranks breaks.
WHOLE_STACK = (
    "decides at the first block whether every later block runs, so it needs all of a call's blocks on one rank"
)


class AgreedResidualChange:
    """FirstBlockCache's decision from its head block's residual change, summed over the ranks holding the call."""

    def __init__(self, hook: FBCHeadBlockHook, measure: SharedMeasure):
        self.hook, self.measure = hook, measure
        self.stock = first_block_decision(hook)

    def __call__(self, residual: torch.Tensor) -> bool:
        previous = self.hook.state_manager.get_state().head_block_residual
        if previous is None or not self.measure.shared():
            return self.stock(residual)
        sums = torch.stack(
            [(residual - previous).abs().sum(dtype=torch.float64), previous.abs().sum(dtype=torch.float64)]
        )
        change, size = self.measure.total(sums).tolist()
        return change / size > self.hook.threshold


class FirstBlockCache(StepCache):
    name = "FirstBlockCache"
    hook_classes = (FBCHeadBlockHook, FBCBlockHook)
    needs = {"blocks": WHOLE_STACK, "pieces": WHOLE_STACK}

    def adapt(self, installed, shares: CallShares) -> None:
        super().adapt(installed, shares)
        for found in self.hooks:
            if isinstance(found.hook, FBCHeadBlockHook):
                decide = AgreedResidualChange(found.hook, shares.measure)
                installed.on_remove(replace_first_block_decision(found.hook, decide))
