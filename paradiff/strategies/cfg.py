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

import inspect

from torch import nn

from ..errors import ParadiffError
from ..layers.batch_split import CfgSplitHook
from ..models import DenoiserFamily
from ..runtime.comm import Communicator
from .base import Strategy
from .costing import CostMachine, CostSetting, StepCost
from .installation import Installation

#: ``__call__`` arguments of pipelines that can run CFG besides a ``negative_*`` one (true CFG, SVD's per-frame
#: scale, InstructPix2Pix's image guidance).
_GUIDANCE_ARGS = ("true_cfg_scale", "max_guidance_scale", "image_guidance_scale")


def cfg_free_reason(pipe, denoiser: nn.Module) -> str | None:
    """Why ``pipe`` never runs classifier-free guidance, or None when it may.

    A pipeline may when its ``__call__`` takes a negative prompt (or image, or embeddings), a true-CFG scale
    or an image guidance scale, or a ``guidance_scale`` that its denoiser does not embed as an input.
    """
    arguments = inspect.signature(type(pipe).__call__).parameters
    if any(name.startswith("negative_") or name in _GUIDANCE_ARGS for name in arguments):
        return None
    config = getattr(denoiser, "config", {})
    if "guidance_scale" not in arguments:
        return "its __call__ takes no guidance scale and no negative prompt"
    if config.get("guidance_embeds") or config.get("time_cond_proj_dim"):
        return "its guidance is distilled into the model (an input of the denoiser), with no negative prompt"
    return None


class CfgStrategy(Strategy):
    name = "cfg"
    call_split = "batch"
    uses_warmup = False
    model_agnostic = True
    cfg_split_alone = True
    world = "world = 2"

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """Each group computes half the batch; the halves' predictions are gathered."""
        w = m.w
        nbytes = w.latent_bytes / 2
        step = m.compute(w.flops / 2) + m.transfer(nbytes, 1)
        return StepCost(step, step, nbytes, nbytes, m.weights)

    @classmethod
    def degrees(cls, world_size, config) -> tuple[int, int]:
        if world_size != 2:
            from . import supported_combinations

            if world_size % 2:  # cfg_parallel needs an even world too: name what runs on this one
                alternative = f"or a strategy that runs on any world (e.g. strategy='parastep') on {world_size}"
            else:
                alternative = (
                    f"or use strategy='patch' with cfg_parallel=True to run patch on {world_size // 2} ranks per half"
                )
            raise ParadiffError(
                f"strategy='cfg' runs the two CFG halves on 2 ranks, got a world of {world_size}; launch 2 ranks, "
                f"{alternative} (supported: {supported_combinations()})"
            )
        return 2, 1

    @classmethod
    def check_pipeline(cls, pipe, denoiser: nn.Module, others: str) -> None:
        """Refuse, before any collective, a pipeline that makes one prediction per step: nothing to split.

        ``others``: the strategies that run the denoiser, for the message.
        """
        reason = cfg_free_reason(pipe, denoiser)
        if reason:
            raise ParadiffError(
                f"{type(pipe).__name__} runs no classifier-free guidance ({reason}), so the CFG split has no two "
                f"halves to run apart; drop cfg_parallel / strategy='cfg' and use {others}"
            )

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
