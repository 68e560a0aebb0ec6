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

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid

_ROTARY = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)


class HunyuanVideoFamily(DenoiserFamily):
    name = "hunyuanvideo"
    class_names = ("HunyuanVideoTransformer3DModel",)
    split_by_plan = True
    joint_text_first = False
    block_stack = BlockStack(
        lists=("transformer_blocks", "single_transformer_blocks"),
        text_arg="encoder_hidden_states",
        # the rotary table, named differently by the two kinds of block
        per_token={name: ContextParallelInput(split_dim=0) for name in ("freqs_cis", "image_rotary_emb")},
    )

    def grid(self, model, latent, inputs):
        patch, frames = model.config.patch_size, latent.shape[-3] // model.config.patch_size_t
        return Grid(rows=frames * (latent.shape[-2] // patch), cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def split_plan(self, model):
        return {
            "rope": {0: _ROTARY, 1: _ROTARY},
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def self_attention(self, model):
        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
        names = [f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))]
        names += [f"single_transformer_blocks.{i}" for i in range(len(model.single_transformer_blocks))]
        return [(f"{name}.attn", block.attn) for name, block in zip(names, blocks, strict=True)]
