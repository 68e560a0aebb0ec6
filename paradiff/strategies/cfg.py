"""CFG split (``cfg``): the two halves of CFG run on two groups of ranks; exact.

Batched CFG (one call of ``[uncond, cond]``): each group runs one half of every call's batch. Two-call
CFG (a ``"cond"`` and an ``"uncond"`` call per step, kept apart by ``cache_context``): each group runs
one of the two calls, at the same time (``paradiff.layers.batch_split.CallPair``).

Alone (``strategy="cfg"``) it runs on 2 ranks. As ``cfg_parallel=True`` it is the outer dimension of
a 2 × D mesh (``paradiff.runtime.mesh``) and another strategy runs each half over D ranks: its hook
wraps that strategy's hooks, so the strategy sees half the batch. It knows no model class: the family
names the latent, the timestep and the arguments that carry no batch, and for a denoiser no family
describes, the latent and the timestep are read from its ``forward`` (``AnyDenoiserFamily``).
"""

from __future__ import annotations

from torch import nn

from ..errors import ParadiffError
from ..layers.batch_split import CfgSplitHook
from ..models import DenoiserFamily
from ..runtime.comm import Communicator
from .base import Strategy
from .installation import Installation


class CfgStrategy(Strategy):
    name = "cfg"
    uses_warmup = False
    model_agnostic = True
    cfg_split_alone = True
    world = "world = 2"

    @classmethod
    def degrees(cls, world_size, config) -> tuple[int, int]:
        if world_size != 2:
            from . import supported_combinations

            raise ParadiffError(
                f"strategy='cfg' runs the two CFG halves on 2 ranks, got a world of {world_size}; launch 2 ranks, "
                f"or use strategy='patch' with cfg_parallel=True to run patch on {world_size // 2} ranks per half "
                f"(supported: {supported_combinations()})"
            )
        return 2, 1

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> Installation:
        """Hook ``denoiser`` to run batch half ``comm.rank`` (of a 2-rank group) and gather both halves.

        Install it after any other strategy on the same denoiser: the hook registered last runs outermost.
        """
        installed = Installation(denoiser, self.name)
        alone = self.groups is not None and self.groups.strategy is None
        installed.hook(denoiser, CfgSplitHook(family, comm, alone))
        return installed.done()
