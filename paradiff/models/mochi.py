"""Mochi 1 (``MochiTransformer3DModel``): a video DiT with asymmetric joint attention (image and prompt streams).

Tokens. The patch embedding runs frame by frame on the whole latent on every rank, and the 3D rotary
table (``rope``: ``(cos, sin)``, one row per image token) on every rank too; the image tokens
(frames × rows × columns, row-major) are cut into one contiguous piece per rank where they enter the
first block, the rotary table the same way at ``rope``'s output, and gathered back at ``proj_out``: a
band of frames when the frames divide by the ranks, of rows otherwise. The prompt stays whole on
every rank (the blocks update it alike everywhere).

What mixes tokens. Only each block's attention. Its processor loops over the batch and, for each
sample, joins the image tokens to that sample's valid prompt tokens (those its mask keeps), image
first: one ``scaled_dot_product_attention`` call per sample, each completed on its own. The prompt
part of each call is whatever is not the rank's image tokens, so the per-sample prompt lengths need
nothing more; the image part of the keys and values is completed to the whole video.

Blocks. ``transformer_blocks`` take and return the image and prompt tokens (image first). The grid's
rows are frames × rows of patches, whole rows of the video in token order.
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid

_ROTARY = ContextParallelInput(split_dim=0, expected_dims=3, split_output=True)


class MochiFamily(DenoiserFamily):
    name = "mochi"
    class_names = ("MochiTransformer3DModel",)
    split_by_plan = True
    joint_text_first = False
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
    )

    def grid(self, model, latent, inputs):
        patch = model.config.patch_size
        return Grid(rows=latent.shape[-3] * (latent.shape[-2] // patch), cols=latent.shape[-1] // patch)

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
