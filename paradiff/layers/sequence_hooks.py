"""Hooks for sequence parallelism: a size check on the denoiser (which also cuts ControlNet's residuals), and the
traffic counters.

diffusers' own split hooks assert that a sequence divides evenly (a bare ``AssertionError``, raised
where ranks may already wait in a collective). This hook runs outside them, sees the call's real
latent (after any resizing the pipeline did), and raises a :class:`ParadiffError` naming sizes that
work, identically on every rank, before the call's first collective.

The collectives themselves run inside diffusers, out of paradiff's sight, so their bytes are counted
from the shapes they move (what each rank sends; the same convention as ``runtime.comm``): per
attention call, Ulysses all-to-alls Q, K, V and the output and keeps 1/D of each; ring all-gathers
K and V. Time blocked in them is part of the attention call and is not in ``wait_s``.
"""

from __future__ import annotations

import math

import diffusers
import torch
from diffusers.hooks import ModelHook

from ..compat import ULYSSES_MASKS_FROM, CallContextHook, ulysses_gathers_key_masks
from ..errors import ParadiffError
from ..models.base import DenoiserFamily, Grid, bind_inputs
from ..runtime.comm import OUTPUT, SYNC, Communicator, tensor_bytes
from .heads import padded_heads
from .split import output_sample


def sequence_split_error(
    strategy: str, family: DenoiserFamily, model, grid: Grid, text_tokens: int | None, parts: int, vae_scale_factor: int
) -> str | None:
    """Why this call's token sequences cannot be cut into ``parts`` equal pieces, naming sizes that work."""
    image = grid.rows * grid.cols
    if image % parts:
        pixels = family.pixels_per_row(model, vae_scale_factor)
        step = parts // math.gcd(grid.cols, parts) * pixels  # heights whose token count divides at this width
        height = grid.rows * pixels
        lower, upper = (height // step) * step, (height // step + 1) * step
        suggestion = f"use height {lower} or {upper}" if lower else f"use height {upper}"
        return (
            f"strategy='{strategy}' splits the image's {grid.rows}×{grid.cols} = {image} tokens ({pixels} pixels per "
            f"token) over {parts} ranks, and {image} is not divisible by {parts}; {suggestion} at this width"
        )
    if text_tokens is not None and text_tokens % parts:
        return (
            f"strategy='{strategy}' splits the {text_tokens} prompt tokens of the {family.name} joint attention over "
            f"{parts} ranks, and {text_tokens} is not divisible by {parts}; give the prompt a multiple of {parts} "
            "tokens (e.g. with the pipeline's max_sequence_length)"
        )
    return None


class SequenceCheckHook(CallContextHook):
    """On the denoiser, outside diffusers' split hooks: checks the call's sizes and counts the step."""

    def __init__(self, strategy: str, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int):
        super().__init__()
        self.strategy, self.family, self.comm, self.vae_scale_factor = strategy, family, comm, vae_scale_factor

    def pre_forward(self, module, *args, **kwargs):
        family = self.family
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        grid = family.grid(module, inputs[family.latent_arg], inputs)
        text = inputs.get(family.context_parallel_text_arg) if family.context_parallel_text_arg else None
        text_tokens = None if text is None else text.shape[1]
        error = sequence_split_error(
            self.strategy, family, module, grid, text_tokens, self.comm.size, self.vae_scale_factor
        )
        if error:
            raise ParadiffError(error)
        masked = [name for name in family.context_parallel_mask_args if _masks_some(inputs.get(name))]
        if masked and not ulysses_gathers_key_masks():
            raise ParadiffError(
                f"this call passes {masked[0]} with masked (padding) tokens, and diffusers {diffusers.__version__}'s "
                f"sequence-parallel attention does not extend a mask over the keys it gathers (diffusers "
                f"{ULYSSES_MASKS_FROM} does); upgrade diffusers, pass prompts without padding, or use strategy='patch'"
            )
        self.comm.state.enter_call(self.context.name, inputs[family.timestep_arg])
        for name in family.token_residual_args:  # ControlNet's residuals: this rank's piece, as diffusers cuts tokens
            if inputs.get(name) is not None:
                inputs[name] = [residual.tensor_split(self.comm.size, 1)[self.comm.rank] for residual in inputs[name]]
        return bound.args, bound.kwargs

    def post_forward(self, module, output):
        comm, sample = self.comm, output_sample(output)  # gathered by diffusers: each rank sent its 1/D
        comm.record(OUTPUT, tensor_bytes(sample) * (comm.size - 1) // comm.size)
        return output


def _masks_some(mask) -> bool:
    return isinstance(mask, torch.Tensor) and not bool(mask.bool().all())


def attention_traffic(module, args, kwargs, size: int, sequence_dim: str) -> int:
    """Bytes a rank sends in one call of attention layer ``module`` under diffusers' Ulysses or ring."""
    inputs = bind_inputs(module, args, kwargs).arguments
    hidden, text = inputs["hidden_states"], inputs.get("encoder_hidden_states")
    tokens = hidden.shape[1] + (0 if text is None else text.shape[1])
    piece = hidden.shape[0] * tokens * module.inner_dim * hidden.element_size()  # one of Q, K, V, output
    if sequence_dim == "ring":
        return 2 * piece * (size - 1)
    heads = getattr(module, "heads", size)
    return 4 * piece * padded_heads(heads, size) // heads * (size - 1) // size  # zero heads pad uneven counts


class AttentionTrafficHook(ModelHook):
    """On an attention layer diffusers runs in parallel: counts the bytes this rank sends per call."""

    def __init__(self, comm: Communicator, sequence_dim: str):
        super().__init__()
        self.comm, self.sequence_dim = comm, sequence_dim

    def pre_forward(self, module, *args, **kwargs):
        self.comm.record(SYNC, attention_traffic(module, args, kwargs, self.comm.size, self.sequence_dim))
        return args, kwargs
