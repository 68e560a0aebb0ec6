"""Hunyuan-DiT (``HunyuanDiT2DModel``): an image DiT with self-attention, cross-attention and U-ViT long skips.

Tokens. The patch embedding (with its sin-cos position table) runs on the whole latent on every rank;
the image tokens (rows × columns of patches, row-major) are cut into one contiguous piece per rank
(a band of rows) where they enter the first block, the 2D rotary table the pipeline passes
(``image_rotary_emb``, ``(cos, sin)``, one row per image token) the same way at the denoiser's input,
and gathered back at ``proj_out``. The prompt (CLIP and T5 tokens) stays whole on every rank.

What mixes tokens. Only each block's self-attention (``attn1``): its keys and values are completed to
the whole image. The cross-attention (``attn2``) attends from the rank's tokens to the whole prompt,
the feed-forward is per token, and a long skip joins a block's tokens to an earlier block's same tokens.

Blocks. ``blocks`` take and return the image tokens; block ``j`` past the middle also reads block
``num_layers - 1 - j``'s output (U-ViT skip): a chain with skips that ``asyncdiff`` cuts (declared
through :meth:`component_units`, not a :class:`BlockStack`: a pipeline of stages would not carry the skips).
"""

from __future__ import annotations

from .base import ComponentUnits, PatchTokensFamily, rotary_input


class HunyuanDiTFamily(PatchTokensFamily):
    declares_components = True
    name = "hunyuandit"
    class_names = ("HunyuanDiT2DModel",)
    tokens_enter = "blocks.0"
    per_token_plan = {"": {"image_rotary_emb": rotary_input()}}
    attention_layers = ("blocks.*.attn1",)
    context_parallel = True
    context_parallel_sdpa = True

    def component_units(self, model):
        layers = len(model.blocks)
        units = tuple((f"blocks.{i}", block) for i, block in enumerate(model.blocks))
        skips = {j: frozenset({layers - 1 - j}) for j in range(layers // 2 + 1, layers)}
        return ComponentUnits(units, skips, ("controlnet_block_samples",))
