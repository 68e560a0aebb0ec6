"""Wan 2.1/2.2 (``WanTransformer3DModel``): a video DiT over frames × rows × columns of patches.

Tokens. The Conv3d patch embedding runs on the whole latent on every rank (it sees every frame and
row it needs), and diffusers' own context-parallel plan for the class cuts the flattened
frames × rows × columns sequence into one contiguous piece per rank at the first block, with the 3D
rotary table cut the same way, and gathers the tokens back before un-patchifying. A contiguous piece
is a band of frames when the frames divide by the ranks, and a band of rows otherwise.

What mixes tokens. Only each block's self-attention (``attn1``): its keys and values are completed to
the whole sequence (displaced: last step's for the other pieces). Full attention does not depend on
the order of its keys, so any contiguous split is exact. The cross-attention (``attn2``) attends from
the rank's tokens to the whole prompt, which every rank holds, and the feed-forward is per token.

Blocks. ``blocks`` run in turn, each taking and returning the image tokens (the prompt, the time
modulation and the rotary table are fixed inputs): a chain that ``asyncdiff`` cuts into components and
``pipefusion`` into stages, its patches being contiguous pieces of the token sequence.

The grid's rows are frames × rows of patches: whole rows of the video in token order.
"""

from __future__ import annotations

from ..compat import ContextParallelInput, shipped_context_parallel_plan
from .base import BlockStack, PatchTokensFamily


class WanFamily(PatchTokensFamily):
    name = "wan"
    class_names = ("WanTransformer3DModel",)
    frames_dim = -3
    context_parallel = True
    block_stack = BlockStack(lists=("blocks",), per_token={"rotary_emb": ContextParallelInput(split_dim=1)})

    def context_parallel_plan(self, model):
        return shipped_context_parallel_plan(model)

    def self_attention(self, model):
        return [
            (name, module)
            for name, module in model.named_modules()
            if hasattr(module, "processor") and getattr(module, "is_cross_attention", True) is False
        ]
