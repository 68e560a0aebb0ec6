"""A hook that runs one half of the denoiser's batch on this rank and gathers both halves' outputs.

Pipelines that use classifier-free guidance batch the unconditional and conditional inputs into one
denoiser call (``[uncond, cond]``, batch 2B). Samples of a batch never interact in a denoiser, so
each of two rank groups can run one half and the two halves' outputs, gathered and concatenated,
are what the whole batch would have given (exact). The pipeline then sees the full output and every
rank continues identically.
"""

from __future__ import annotations

import inspect

import torch

from ..compat import CallContextHook
from ..errors import ParadiffError
from ..models.base import DenoiserFamily, bind_inputs
from ..runtime.comm import CFG, Communicator
from ..runtime.step_state import timestep_key
from .split import output_sample, replace_output_sample


def batch_rows(value, batch: int, rows: slice):
    """``value`` cut to the samples ``rows`` of a call's ``batch``: every tensor whose first dimension is ``batch``.

    Recurses into lists, tuples and dicts (``added_cond_kwargs``, ControlNet residuals); other values
    and tensors of another first dimension (a scalar timestep) are left whole.
    """
    if isinstance(value, torch.Tensor):
        return value[rows] if value.ndim and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {key: batch_rows(item, batch, rows) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(batch_rows(item, batch, rows) for item in value)
    return value


def odd_batch_message(batch: int, alone: bool) -> str:
    """Why a call of ``batch`` samples cannot be split, and what to run instead (``alone``: strategy='cfg')."""
    split, instead = (
        ("strategy='cfg'", "use strategy='patch' or 'parastep' instead of 'cfg'")
        if alone
        else ("cfg_parallel", "run without cfg_parallel")
    )
    return (
        f"{split} splits each denoiser call's batch into two halves, one per group of ranks, or gives the two "
        f"calls of two-call guidance one each, but this call has a batch of {batch} and no second call to pair "
        "with. Supported: pipelines that batch classifier-free guidance into one call ([uncond, cond]: SD, SDXL, "
        "PixArt, SD3) with guidance_scale > 1, pipelines that make two calls per step, conditional and "
        "unconditional (Flux true CFG, Wan, QwenImage, Chroma), or any even batch. Guidance off or distilled "
        "guidance (Flux without a negative prompt) give one call of the image count per step: generate an even "
        f"number of images, or {instead}"
    )


class CfgSplitHook(CallContextHook):
    """On the denoiser, outermost: each CFG group runs its part of every call; the outputs are shared.

    A call with an even batch (batched CFG) is cut into halves, one per group, and the halves' outputs
    are gathered. Two-call CFG is paired (:class:`CallPair`). A strategy hooked inside this one (patch)
    sees the calls its group runs, as if the pipeline made them.
    """

    def __init__(self, family: DenoiserFamily, comm: Communicator, alone: bool = False):
        super().__init__()
        #: ``alone``: the split is the whole strategy (``strategy="cfg"``), not composed with another one.
        self.family, self.comm, self.alone = family, comm, alone
        self.pair = CallPair(comm)

    def new_forward(self, module, *args, **kwargs):
        family, comm = self.family, self.comm
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        latent, context = inputs[family.latent_arg], self.context.name
        comm.state.enter_call(context, inputs[family.timestep_arg] if family.timestep_arg else 0)
        if latent.shape[0] % 2 == 0:
            comm.state.cfg_call = "halves"
            half_args, half_kwargs = self.halve(bound)
            output = self.fn_ref.original_forward(*half_args, **half_kwargs)
            return replace_output_sample(output, comm.all_gather_output(output_sample(output), dim=0, kind=CFG))
        timestep = inputs[family.timestep_arg] if family.timestep_arg else 0
        if not self.pair.paired(timestep):
            raise ParadiffError(odd_batch_message(latent.shape[0], self.alone))
        comm.state.cfg_call = "second" if self.pair.index else "first"
        if inputs.get("return_dict", True):
            raise ParadiffError(
                "the CFG split pairs two-call guidance only for calls with return_dict=False, as diffusers' "
                "two-call pipelines make them"
            )
        return self.pair.call(latent, lambda: self.fn_ref.original_forward(*args, **kwargs))

    def halve(self, bound: inspect.BoundArguments) -> tuple[tuple, dict]:
        """The call's arguments cut to this rank's half of the batch (every argument that carries the batch)."""
        family, inputs = self.family, bound.arguments
        batch = inputs[family.latent_arg].shape[0]
        half = slice(self.comm.rank * batch // 2, (self.comm.rank + 1) * batch // 2)  # the cfg group's rank
        for name, value in list(inputs.items()):
            if name in family.frame_batched_args and isinstance(value, torch.Tensor):
                inputs[name] = value.chunk(2)[self.comm.rank]
            elif name not in family.unbatched_args:
                inputs[name] = batch_rows(value, batch, half)
        return bound.args, bound.kwargs


class CallPair:
    """Two-call CFG: each CFG group runs one of a step's two calls, and both get both outputs.

    The two calls of a step are told apart by their order at one timestep (whatever ``cache_context``
    names them, if any): the group of rank ``g`` runs call ``g`` of each step. The pipeline makes the
    calls one after the other, so the group that does not run the first call returns a placeholder at
    once (filled with NaN, shaped like the latent) and is already computing the second call while the
    other group computes the first. When both have run, the two outputs are exchanged and each group
    writes the one it did not compute into its placeholder, in place: the pipeline combines them only
    after the second call. The first step runs both calls on both groups; it shows whether every step
    makes two calls (a pipeline that makes one call per step is refused at the next step, before a
    placeholder is handed out).
    """

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.run = -1
        #: Calls the first step made, this ``pipe(...)`` call; the last call's timestep and place in its step.
        self.first_step_calls, self.timestep, self.index = 0, None, 0
        #: The first call of the open pair: this group's output or placeholder, and whether this group ran it.
        self.pending: tuple[torch.Tensor, bool] | None = None

    def paired(self, timestep) -> bool:
        """Place this call in its step; whether it can be paired: during the first step always, later if that
        step made two calls."""
        state = self.comm.state
        if self.run != state.run:
            self.run, self.first_step_calls, self.timestep, self.pending = state.run, 0, None, None
        key = timestep_key(timestep)
        self.index = self.index + 1 if key == self.timestep else 0
        self.timestep = key
        if state.step == 0:
            self.first_step_calls = max(self.first_step_calls, self.index + 1)
            return True
        return self.first_step_calls == 2

    def call(self, latent: torch.Tensor, forward):
        if self.comm.state.step == 0:
            return forward()
        if self.index > 1 or (self.index == 1) != (self.pending is not None):
            raise ParadiffError(
                "the pipeline's calls do not come in pairs at one timestep; the CFG split pairs a step's "
                "conditional and unconditional calls"
            )
        mine = self.index == self.comm.rank
        output = forward() if mine else (torch.full_like(latent, float("nan")),)
        sample = output_sample(output)
        if self.pending is None:
            self.pending = (sample.detach().clone() if mine else sample, mine)
            return output
        first, first_mine = self.pending
        self.pending = None
        computed, placeholder = (first, sample) if first_mine else (sample, first)
        other = self.comm.all_gather_output(computed.contiguous(), dim=0, kind=CFG).chunk(2)[1 - self.comm.rank]
        if other.shape != placeholder.shape:
            raise ParadiffError(
                f"the CFG split pairs two-call guidance for denoisers whose output is shaped like their latent input "
                f"{tuple(placeholder.shape)}; this one returns {tuple(other.shape)}"
            )
        placeholder.copy_(other)
        return output
