"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): a video DiT with dual- then single-stream blocks.

Tokens. The Conv3d patch embedding (``x_embedder``) and the 3D rotary table (``rope``, one row per
image token) run whole on every rank; the image tokens (frames × rows × columns, row-major) are cut
into one contiguous piece per rank where they enter the first block, the rotary table alike, and
gathered back at ``proj_out``: a band of frames when the frames divide by the ranks, of rows otherwise.
diffusers ships no context-parallel plan for this class, so the plan is declared here.

What mixes tokens. Only the attention of every block, where the prompt's tokens (whole on every
rank, refined by the token refiner alike everywhere) come after the image tokens: the image part of
the keys and values is completed to the whole video. The attention mask the model builds covers the
whole image and the prompt, so it already fits the completed keys.

Blocks. ``transformer_blocks`` (dual-stream) then ``single_transformer_blocks``, all taking and
returning the image and prompt tokens (image first). The grid's rows are frames × rows of patches.
"""

from __future__ import annotations

from ..compat import ContextParallelInput
from .base import BlockStack, PatchTokensFamily, rotary_outputs


class HunyuanVideoFamily(PatchTokensFamily):
    name = "hunyuanvideo"
    class_names = ("HunyuanVideoTransformer3DModel",)
    tokens_enter = "transformer_blocks.0"
    per_token_plan = {"rope": rotary_outputs()}
    attention_layers = ("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
    frames_dim = -3
    joint_text_first = False
    block_stack = BlockStack(
        lists=("transformer_blocks", "single_transformer_blocks"),
        text_arg="encoder_hidden_states",
        # the rotary table, named differently by the two kinds of block
        per_token={name: ContextParallelInput(split_dim=0) for name in ("freqs_cis", "image_rotary_emb")},
    )
