"""Latte (``LatteTransformer3DModel``): a video DiT alternating spatial blocks (within a frame) and temporal blocks.

Tokens. The patch embedding (with its sin-cos position table) runs frame by frame on the whole latent
on every rank. The spatial blocks see ``(batch·frames, rows·columns)`` tokens: they are cut along
the tokens of each frame, where they enter the first spatial block, into one contiguous piece per
rank, which is a band of rows of every frame, and gathered back at ``proj_out``. Between blocks the
model reshapes the rank's tokens to ``(batch·its tokens, frames)`` and back, using only their local
count, so a band of rows stays a band of rows. The temporal blocks' timestep table
(``timestep_temp``: each sample's timestep repeated over its tokens, ``(batch·rows·columns, ·)``) is
cut to the rank's share along dim 0: its rows for the rank's tokens when every sample of the batch has
the same timestep, as every diffusers pipeline calls it (a contiguous cut of a (sample, token) table
is not the rank's tokens of each sample otherwise).

What mixes tokens. Only each spatial block's self-attention (``transformer_blocks.*.attn1``): its keys
and values are completed to the whole frame (per frame: batch·frames is the batch of that attention).
The temporal blocks attend over the frames of one token, all on the rank: they are left alone. The
cross-attention attends to the whole prompt, the feed-forward is per token.

Blocks. ``transformer_blocks`` and ``temporal_transformer_blocks`` alternate, each taking and returning
the image tokens (reshaped between them by the model): one chain that ``asyncdiff`` cuts (declared
through :meth:`component_units`: the two lists interleave, which a :class:`BlockStack` cannot say).
"""

from __future__ import annotations

from ..compat import ContextParallelInput
from .base import ComponentUnits, PatchTokensFamily


class LatteFamily(PatchTokensFamily):
    declares_components = True
    name = "latte"
    class_names = ("LatteTransformer3DModel",)
    tokens_enter = "transformer_blocks.0"
    #: The temporal blocks' timestep table, one row per (sample, token): see the module docstring.
    per_token_plan = {"temporal_transformer_blocks.*": {"timestep": ContextParallelInput(split_dim=0, expected_dims=2)}}
    attention_layers = ("transformer_blocks.*.attn1",)
    context_parallel = True
    context_parallel_sdpa = True

    def component_units(self, model):
        names = []
        for i in range(len(model.transformer_blocks)):
            names += [f"transformer_blocks.{i}", f"temporal_transformer_blocks.{i}"]
        return ComponentUnits(tuple((name, model.get_submodule(name)) for name in names), {})
