"""CogView4 (``CogView4Transformer2DModel``): an image DiT with joint text-image attention and 2D rotary positions.

Tokens. The patch embedding (a linear layer over 2×2 latent patches) and the rotary table (``rope``,
``(cos, sin)``, one row per image token) run whole on every rank; the image tokens (rows × columns,
row-major) are cut into one contiguous piece per rank (a band of rows) where they enter the first
block, the rotary table the same way at ``rope``'s output, and gathered back at ``proj_out``. The
prompt stays whole on every rank: the blocks update it alike everywhere, so nothing about it is exchanged.

What mixes tokens. Only each block's attention, where the prompt's tokens come first and the image
tokens after them: the image part of the keys and values is completed to the whole image. (A prompt
``attention_mask``, which the pipeline does not pass, is turned by the processor into a 0/1 float bias
over the keys; that is refused.)

Blocks. ``transformer_blocks`` take and return the image and prompt tokens (image first).
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid

_ROTARY = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)


class CogView4Family(DenoiserFamily):
    name = "cogview4"
    class_names = ("CogView4Transformer2DModel",)
    split_by_plan = True
    joint_text_first = True
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
    )

    def grid(self, model, latent, inputs):
        patch = model.config.patch_size
        return Grid(rows=latent.shape[-2] // patch, cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def split_plan(self, model):
        return {
            "rope": {0: _ROTARY, 1: _ROTARY},
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def self_attention(self, model):
        return [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(model.transformer_blocks)]
