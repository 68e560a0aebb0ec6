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

from ..compat import ContextParallelInput
from .base import BlockStack, PatchTokensFamily, rotary_outputs


class MochiFamily(PatchTokensFamily):
    name = "mochi"
    class_names = ("MochiTransformer3DModel",)
    tokens_enter = "transformer_blocks.0"
    per_token_plan = {"rope": rotary_outputs(dims=3)}
    attention_layers = ("transformer_blocks.*.attn1",)
    frames_dim = -3
    joint_text_first = False
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
    )
