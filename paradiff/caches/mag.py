"""MagCache: skip every block but the first while the accumulated error of a precomputed magnitude-ratio schedule
stays below a threshold, reusing the last residual (diffusers' ``MagCacheConfig``).

Its schedule counts calls per ``cache_context`` against ratios fixed in advance, and its reuse is per token, so every
rank that runs a call's blocks on its part decides and reuses as one device would. Its calibration
(``calibrate=True``) measures the residual's norm over a call, which a cut call has only in parts.
"""

from __future__ import annotations

from diffusers.hooks.mag_cache import MagCacheBlockHook, MagCacheHeadHook

from .base import StepCache
from .first_block import WHOLE_STACK

#: What MagCache's calibration does that a call cut over the ranks breaks.
CALIBRATION = (
    "calibrates (calibrate=True) from the residual's norm over each whole call, so it needs the whole call on one "
    "rank; calibrate on one device and pass the printed mag_ratios"
)


class MagCache(StepCache):
    name = "MagCache"
    hook_classes = (MagCacheHeadHook, MagCacheBlockHook)
    needs = {"blocks": WHOLE_STACK, "pieces": WHOLE_STACK}

    def refusal(self, split: str | None) -> str | None:
        calibrating = any(getattr(found.hook.config, "calibrate", False) for found in self.hooks)
        if calibrating and split in ("tokens", "batch"):
            return CALIBRATION
        return super().refusal(split)
