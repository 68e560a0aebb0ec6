"""CFG split (``cfg``): the two halves of every denoiser call's batch run on two groups of ranks; exact.

Alone (``strategy="cfg"``) it runs on 2 ranks. As ``cfg_parallel=True`` it is the outer dimension of
a 2 × D mesh (``paradiff.runtime.mesh``) and another strategy runs each half over D ranks: its hook
wraps that strategy's hooks, so the strategy sees half the batch. Like the other strategies, it knows
no model class: the family names the latent, the timestep and the arguments that carry no batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusers.hooks import HookRegistry
from torch import nn

from ..layers.batch_split import CfgSplitHook
from ..models import DenoiserFamily
from ..runtime.comm import Communicator

HOOK_NAME = "paradiff.cfg"


@dataclass
class InstalledCfg:
    """The hook :class:`CfgStrategy` put on one denoiser, so that it can be removed."""

    denoiser: nn.Module

    def remove(self) -> None:
        self.denoiser._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)


class CfgStrategy:
    name = "cfg"
    #: Exact at every step: ``warmup_steps`` changes nothing.
    uses_warmup = False

    def install(self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator) -> InstalledCfg:
        """Hook ``denoiser`` to run batch half ``comm.rank`` (of a 2-rank group) and gather both halves.

        Install it after any other strategy on the same denoiser: the hook registered last runs outermost.
        """
        HookRegistry.check_if_exists_or_initialize(denoiser).register_hook(CfgSplitHook(family, comm), HOOK_NAME)
        return InstalledCfg(denoiser)
