"""Strategies: each says how a denoiser's work is split over ranks and which layers are swapped.

The strategies that run within each batch half (all but ``cfg``) share one protocol, used by
``paradiff.pipeline``: ``check_model(denoiser, family, degree, config)`` (class method, before any collective),
``create(config, groups)``, ``check_height(...)`` (before each call) and ``install(...)``. A strategy that
steers the pipeline's loop (``parastep``) also gives its installed part ``steer(pipe)``, a context manager
around each call, and one that never looks inside the denoiser sets ``model_agnostic``.
"""

from __future__ import annotations

from .asyncdiff import AsyncDiffStrategy
from .cfg import CfgStrategy
from .parastep import ParaStepStrategy
from .patch import PatchStrategy
from .pipefusion import PipeFusionStrategy
from .sequence import RingStrategy, SequenceStrategy, UlyssesStrategy

STRATEGIES = {
    strategy.name: strategy
    for strategy in (
        PatchStrategy,
        PipeFusionStrategy,
        ParaStepStrategy,
        AsyncDiffStrategy,
        CfgStrategy,
        UlyssesStrategy,
        RingStrategy,
    )
}

__all__ = [
    "STRATEGIES",
    "AsyncDiffStrategy",
    "CfgStrategy",
    "ParaStepStrategy",
    "PatchStrategy",
    "PipeFusionStrategy",
    "RingStrategy",
    "SequenceStrategy",
    "UlyssesStrategy",
]
