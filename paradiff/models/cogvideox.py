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

from ..compat import ContextParallelInput
from .base import BlockStack, PatchTokensFamily, rotary_input


class CogVideoXFamily(PatchTokensFamily):
    name = "cogvideox"
    class_names = ("CogVideoXTransformer3DModel",)
    tokens_enter = "transformer_blocks.0"
    per_token_plan = {"": {"image_rotary_emb": rotary_input()}}
    attention_layers = ("transformer_blocks.*.attn1",)
    context_parallel = True
    context_parallel_sdpa = True
    context_parallel_text_arg = "encoder_hidden_states"
    frames_dim = 1
    joint_text_first = True
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
    )
