"""Allegro (``AllegroTransformer3DModel``): a video DiT with self-attention, cross-attention and 3D rotary positions.

Tokens. The patch embedding runs frame by frame on the whole latent on every rank; the image tokens
(frames × rows × columns, row-major) are cut into one contiguous piece per rank where they enter the
first block, and gathered back at ``proj_out``: a band of frames when the frames divide by the ranks,
of rows otherwise. The pipeline's rotary input is ``((freqs_t, freqs_h, freqs_w), (grid_t, grid_h,
grid_w))``: the frequency tables are indexed by position and stay whole; only the position grids
(``(1, tokens)`` each) are per token, and are cut the same way at the denoiser's input (a nested spec).
The prompt stays whole on every rank.

What mixes tokens. Only each block's self-attention (``attn1``): its keys and values are completed to
the whole video. The cross-attention (``attn2``) attends to the whole prompt, the feed-forward is per token.
(A video ``attention_mask``, which the pipeline does not pass, is not supported.)

Blocks. ``transformer_blocks`` take and return the image tokens (the prompt is a fixed input). The
grid's rows are frames × rows of patches, whole rows of the video in token order.
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid

_POSITIONS = ContextParallelInput(split_dim=1, expected_dims=2)


class AllegroFamily(DenoiserFamily):
    name = "allegro"
    class_names = ("AllegroTransformer3DModel",)
    split_by_plan = True
    #: Its frequency tables have one row per position (as many as frames, say), not per sample.
    unbatched_args = ("image_rotary_emb",)
    block_stack = BlockStack(
        lists=("transformer_blocks",), per_token={"image_rotary_emb": (None, (_POSITIONS, _POSITIONS, _POSITIONS))}
    )

    def grid(self, model, latent, inputs):
        patch, frames = model.config.patch_size, latent.shape[-3] // model.config.patch_size_t
        return Grid(rows=frames * (latent.shape[-2] // patch), cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def split_plan(self, model):
        return {
            "": {"image_rotary_emb": (None, (_POSITIONS, _POSITIONS, _POSITIONS))},
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def self_attention(self, model):
        return [(f"transformer_blocks.{i}.attn1", block.attn1) for i, block in enumerate(model.transformer_blocks)]
