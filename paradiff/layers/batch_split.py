"""A hook that runs one half of the denoiser's batch on this rank and gathers both halves' outputs.

Pipelines that use classifier-free guidance batch the unconditional and conditional inputs into one
denoiser call (``[uncond, cond]``, batch 2B). Samples of a batch never interact in a denoiser, so
each of two rank groups can run one half and the two halves' outputs, gathered and concatenated,
are what the whole batch would have given (exact). The pipeline then sees the full output and every
rank continues identically.
"""

from __future__ import annotations

import torch

from ..compat import CallContextHook
from ..errors import ParadiffError
from ..models.base import DenoiserFamily, bind_inputs
from ..runtime.comm import CFG, Communicator
from .split import output_sample, replace_output_sample


def batch_half(value, batch: int, half: int):
    """``value`` cut to batch half ``half`` (0 or 1): every tensor whose first dimension is ``batch``.

    Recurses into lists, tuples and dicts (``added_cond_kwargs``, ControlNet residuals); other values
    and tensors of another first dimension (a scalar timestep) are left whole.
    """
    if isinstance(value, torch.Tensor):
        return value.narrow(0, half * batch // 2, batch // 2) if value.ndim and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {key: batch_half(item, batch, half) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(batch_half(item, batch, half) for item in value)
    return value


def odd_batch_message(batch: int, alone: bool) -> str:
    """Why a call of ``batch`` samples cannot be split, and what to run instead (``alone``: strategy='cfg')."""
    split, instead = (
        ("strategy='cfg'", "use strategy='patch' or 'parastep' instead of 'cfg'")
        if alone
        else ("cfg_parallel", "run without cfg_parallel")
    )
    return (
        f"{split} splits each denoiser call's batch into two halves, one per group of ranks, but this call "
        f"has a batch of {batch}. Supported: pipelines that batch classifier-free guidance into one call "
        "([uncond, cond]: SD, SDXL, PixArt, SD3) with guidance_scale > 1, or any even batch. Guidance off, "
        "distilled guidance (Flux) or guidance as two denoiser calls (Flux true CFG) give a batch of the image "
        f"count: generate an even number of images, or {instead}"
    )


class CfgSplitHook(CallContextHook):
    """On the denoiser, outermost: cuts every call's batch to this rank's half, gathers the outputs.

    A strategy hooked inside it (patch) sees a call of half the batch, as if the pipeline made it.
    """

    def __init__(self, family: DenoiserFamily, comm: Communicator, alone: bool = False):
        super().__init__()
        #: ``alone``: the split is the whole strategy (``strategy="cfg"``), not composed with another one.
        self.family, self.comm, self.alone = family, comm, alone

    def pre_forward(self, module, *args, **kwargs):
        family = self.family
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        batch = inputs[family.latent_arg].shape[0]
        if batch % 2:
            raise ParadiffError(odd_batch_message(batch, self.alone))
        self.comm.state.enter_call(self.context.name, inputs[family.timestep_arg] if family.timestep_arg else 0)
        for name, value in list(inputs.items()):
            if name not in family.unbatched_args:
                inputs[name] = batch_half(value, batch, self.comm.rank)  # the cfg group's rank is its half
        return bound.args, bound.kwargs

    def post_forward(self, module, output):
        return replace_output_sample(output, self.comm.all_gather_output(output_sample(output), dim=0, kind=CFG))

