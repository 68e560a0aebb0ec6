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

from ..compat import ContextParallelInput
from .base import BlockStack, PatchTokensFamily, rotary_outputs


class CogView4Family(PatchTokensFamily):
    name = "cogview4"
    class_names = ("CogView4Transformer2DModel",)
    tokens_enter = "transformer_blocks.0"
    per_token_plan = {"rope": rotary_outputs()}
    attention_layers = ("transformer_blocks.*.attn1",)
    context_parallel = True
    context_parallel_sdpa = True
    context_parallel_text_arg = "encoder_hidden_states"
    joint_text_first = True
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
    )
