"""CogVideoX 1.0/1.5 (``CogVideoXTransformer3DModel``): a video DiT with joint text-video attention.

Tokens. The patch embedding runs on the whole latent on every rank (it also adds the learned position
table of the models without rotary positions). The image tokens (frames × rows × columns, row-major)
are cut into one contiguous piece per rank where they enter the first block, with the 3D rotary table
the pipeline passes (``image_rotary_emb``, one row per image token) cut the same way, and gathered
back at ``proj_out``: a band of frames when the frames divide by the ranks, a band of rows otherwise.

What mixes tokens. Only each block's attention, where the prompt's tokens (whole on every rank; the
blocks update them alike everywhere) come first and the image tokens after them: the image part of
the keys and values is completed to the whole video, the prompt part is the rank's own.

Blocks. ``transformer_blocks`` take and return the image and prompt tokens (image first); the grid's
rows are frames × rows of patches, whole rows of the video in token order.
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid

_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)


class CogVideoXFamily(DenoiserFamily):
    name = "cogvideox"
    class_names = ("CogVideoXTransformer3DModel",)
    split_by_plan = True
    joint_text_first = True
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
    )

    def grid(self, model, latent, inputs):
        patch, frames = model.config.patch_size, -(-latent.shape[1] // (model.config.patch_size_t or 1))
        return Grid(rows=frames * (latent.shape[-2] // patch), cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def context_parallel_plan(self, model):
        return {
            "": {"image_rotary_emb": ContextParallelInput(split_dim=0, expected_dims=2)},
            "transformer_blocks.0": {"hidden_states": _TOKENS},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def self_attention(self, model):
        return [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(model.transformer_blocks)]
