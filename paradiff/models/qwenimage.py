"""Qwen-Image (``QwenImageTransformer2DModel``): a dual-stream DiT with joint text-image attention.

Tokens. The latent arrives packed into tokens (2×2 latent pixels each, row-major). diffusers' own
context-parallel plan for the class (as diffusers 0.42 ships it) serves ``ulysses``: it cuts the image
and prompt tokens, the prompt mask and both rotary tables at the first block, and gathers at ``proj_out``. The displaced
strategies cut only the image tokens and the image rotary table and keep the prompt whole on every rank
(each block updates it alike everywhere), so nothing about the prompt is exchanged.

What mixes tokens. Only each block's joint attention, prompt tokens first: the image part of the keys
and values is completed to the whole image; the prompt mask is extended over the completed image.

Blocks. ``transformer_blocks`` take the image and prompt tokens and return both (prompt first).
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid, require

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)
_PER_TOKEN = ContextParallelInput(split_dim=1, expected_dims=2)
_TABLE = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)


class QwenImageFamily(DenoiserFamily):
    name = "qwenimage"
    class_names = ("QwenImageTransformer2DModel",)
    attention_layers = ("transformer_blocks.*.attn",)
    split_by_plan = True
    joint_text_first = True
    context_parallel = True
    context_parallel_text_arg = "encoder_hidden_states"
    context_parallel_mask_args = ("encoder_hidden_states_mask",)
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        # the image's rotary table, then the prompt's (kept whole); the per-token modulation of the edit models
        per_token={
            "image_rotary_emb": (ContextParallelInput(split_dim=0), None),
            "modulate_index": ContextParallelInput(split_dim=1),
        },
    )

    def grid(self, model, latent, inputs):
        shapes = inputs.get("img_shapes")
        require(bool(shapes), "Qwen-Image's transformer needs img_shapes")
        _, rows, cols = shapes[0][0]
        return Grid(rows=rows, cols=cols)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def context_parallel_plan(self, model):
        # diffusers' own plan as 0.42 ships it; before (0.38) it left the prompt mask whole while cutting the
        # prompt, which breaks a padded prompt (a negative prompt shorter than the positive one)
        return {
            "transformer_blocks.0": {
                "hidden_states": _TOKENS,
                "encoder_hidden_states": _TOKENS,
            },
            "transformer_blocks.*": {
                "modulate_index": _PER_TOKEN,
                "encoder_hidden_states_mask": _PER_TOKEN,
            },
            "pos_embed": {0: _TABLE, 1: _TABLE},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def split_plan(self, model):
        return {
            "transformer_blocks.0": {"hidden_states": _TOKENS},
            "transformer_blocks.*": {"modulate_index": _PER_TOKEN},
            "pos_embed": {0: _TABLE},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
