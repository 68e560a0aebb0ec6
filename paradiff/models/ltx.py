"""LTX-Video (``LTXVideoTransformer3DModel``): a video DiT with self-attention and cross-attention to the prompt.

Tokens. The latent arrives already packed into tokens (frames × rows × columns, row-major). The
displaced strategies cut the image tokens and the rotary table into one contiguous piece per rank at
the input, as diffusers' own context-parallel plan for the class does, and gather at ``proj_out``;
unlike that plan they keep the prompt whole on every rank, so each block's cross-attention (``attn2``)
is local to the rank and exact, its prompt mask included, and nothing about the prompt is exchanged.

Not ``ulysses``/``ring``: under diffusers' plan the cross-attention's prompt mask keeps every head
while Ulysses gives each rank some of them (a shape error in diffusers 0.42 whenever the pipeline
passes its prompt mask, which it always does).

What mixes tokens. Only each block's self-attention (``attn1``), whose keys and values are completed
to the whole video; a contiguous piece is a band of frames when the frames divide by the ranks.

Blocks. ``transformer_blocks`` take and return the image tokens (the prompt is a fixed input). The
grid's rows are frames × rows of tokens.
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid, require

_ROTARY = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)


class LTXFamily(DenoiserFamily):
    name = "ltx"
    class_names = ("LTXVideoTransformer3DModel",)
    attention_layers = ("transformer_blocks.*.attn1",)
    split_by_plan = True
    block_stack = BlockStack(lists=("transformer_blocks",), per_token={"image_rotary_emb": _ROTARY})

    def grid(self, model, latent, inputs):
        frames, rows, cols = inputs.get("num_frames"), inputs.get("height"), inputs.get("width")
        require(None not in (frames, rows, cols), "LTX-Video's transformer needs num_frames, height and width")
        return Grid(rows=frames * rows, cols=cols)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def split_plan(self, model):
        return {
            "": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "rope": {0: _ROTARY, 1: _ROTARY},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
