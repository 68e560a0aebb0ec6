"""Strategies: each says how a denoiser's work is split over ranks and which layers are swapped."""

from __future__ import annotations

from .patch import PatchStrategy

STRATEGIES = {PatchStrategy.name: PatchStrategy}

__all__ = ["STRATEGIES", "PatchStrategy"]
