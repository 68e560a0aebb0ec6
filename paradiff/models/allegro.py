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

from ..compat import ContextParallelInput
from .base import BlockStack, PatchTokensFamily

_POSITIONS = ContextParallelInput(split_dim=1, expected_dims=2)


class AllegroFamily(PatchTokensFamily):
    name = "allegro"
    class_names = ("AllegroTransformer3DModel",)
    tokens_enter = "transformer_blocks.0"
    per_token_plan = {"": {"image_rotary_emb": (None, (_POSITIONS, _POSITIONS, _POSITIONS))}}
    attention_layers = ("transformer_blocks.*.attn1",)
    frames_dim = -3
    #: Its frequency tables have one row per position (as many as frames, say), not per sample.
    unbatched_args = ("image_rotary_emb",)
    block_stack = BlockStack(
        lists=("transformer_blocks",), per_token={"image_rotary_emb": (None, (_POSITIONS, _POSITIONS, _POSITIONS))}
    )
