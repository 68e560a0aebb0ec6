"""Hooks that cut the image into row bands where it enters the denoiser and join it where it leaves."""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from ..compat import CallContextHook
from ..errors import ParadiffError
from ..models.base import DenoiserFamily, bind_inputs, slice_rows
from ..runtime.comm import Communicator
from ..runtime.step_state import RowPartition


def band_rows_error(rows: int, family: DenoiserFamily, model, parts: int, vae_scale_factor: int) -> str | None:
    """Why ``rows`` grid rows cannot be cut into ``parts`` aligned bands, naming heights that work."""
    multiple = family.row_multiple(model) * parts
    if rows % multiple == 0:
        return None
    pixels = family.pixels_per_row(model, vae_scale_factor)
    step = multiple * pixels
    height = rows * pixels
    lower, upper = (height // step) * step, (height // step + 1) * step
    suggestion = f"use {lower} or {upper}" if lower else f"use {upper}"
    return (
        f"height {height} is not divisible by {step} ({pixels} pixels per row × {family.row_multiple(model)} "
        f"row alignment of the {family.name} model × {parts} ranks); {suggestion}"
    )


class BandSplitHook(CallContextHook):
    """On the denoiser: counts the step, plans the bands, slices the inputs, gathers the output."""

    def __init__(self, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int):
        super().__init__()
        self.family, self.comm, self.vae_scale_factor = family, comm, vae_scale_factor

    def pre_forward(self, module, *args, **kwargs):
        family, state = self.family, self.comm.state
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        grid = family.grid(module, inputs[family.latent_arg], inputs)
        error = band_rows_error(grid.rows, family, module, self.comm.size, self.vae_scale_factor)
        if error and family.whole_when_unsplittable:
            state.partition = None
            return args, kwargs
        if error:
            raise ParadiffError(error)
        state.enter_call(self.context.name, inputs[family.timestep_arg] if family.timestep_arg else 0)
        state.partition = RowPartition(grid.rows, grid.cols, self.comm.size, self.comm.rank)
        rows = slice(state.partition.row_start, state.partition.row_start + state.partition.band_rows)
        family.split_inputs(module, inputs, rows, grid)
        for name in family.token_residual_args:  # ControlNet's residuals, added to the rank's rows of tokens
            if inputs.get(name) is not None:
                inputs[name] = [slice_rows(residual, 1, rows, grid.cols) for residual in inputs[name]]
        return bound.args, bound.kwargs

    def post_forward(self, module, output):
        if self.family.output_module is not None or self.comm.state.partition is None:
            return output
        return replace_output_sample(output, self.comm.end_call(output_sample(output), self.family.output_dim))


class TokenSliceHook(ModelHook):
    """On the module that produces the image tokens: keep the rank's rows of tokens."""

    def __init__(self, comm: Communicator):
        super().__init__()
        self.comm = comm

    def post_forward(self, module, output: torch.Tensor) -> torch.Tensor:
        part = self.comm.state.partition
        return slice_rows(output, 1, slice(part.row_start, part.row_start + part.band_rows), part.cols)


class TokenGatherHook(ModelHook):
    """On the last per-token projection: gather every rank's tokens back into the full sequence."""

    def __init__(self, comm: Communicator):
        super().__init__()
        self.comm = comm

    def post_forward(self, module, output: torch.Tensor) -> torch.Tensor:
        return self.comm.end_call(output, dim=1)


def output_sample(output):
    """The noise prediction in a denoiser's output (a tensor, a ``return_dict=False`` tuple or an output object)."""
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, tuple) else output.sample


def replace_output_sample(output, sample):
    """``output`` with its noise prediction replaced by ``sample``, in the same form."""
    if isinstance(output, torch.Tensor):
        return sample
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output.sample = sample
    return output
