"""Strategies: each says how a denoiser's work is split over ranks and which layers are swapped.

The strategies that run within each batch half (all but ``cfg``) share one protocol, used by
``paradiff.pipeline``: ``check_model(denoiser, family, degree, config)`` (class method, before any collective),
``create(config, groups)``, ``check_height(...)`` (before each call) and ``install(...)``.
"""

from __future__ import annotations

from .cfg import CfgStrategy
from .patch import PatchStrategy
from .pipefusion import PipeFusionStrategy
from .sequence import RingStrategy, SequenceStrategy, UlyssesStrategy

STRATEGIES = {
    strategy.name: strategy
    for strategy in (PatchStrategy, PipeFusionStrategy, CfgStrategy, UlyssesStrategy, RingStrategy)
}

__all__ = [
    "STRATEGIES",
    "CfgStrategy",
    "PatchStrategy",
    "PipeFusionStrategy",
    "RingStrategy",
    "SequenceStrategy",
    "UlyssesStrategy",
]
