"""AuraFlow (``AuraFlowTransformer2DModel``): an MMDiT with joint blocks, then single blocks on the joined tokens.

Tokens. The patch embedding (with its learned position table, cropped to the image) runs on the whole
latent on every rank; the image tokens (rows × columns of patches, row-major) are cut into one
contiguous piece per rank (a band of rows) where they enter the first joint block, and gathered back at
``proj_out``. The prompt, with the learned register tokens put before it, stays whole on every rank:
the blocks update it alike everywhere, so nothing about it is exchanged.

What mixes tokens. Only the attention of every block, where the registers and prompt come first and the
image tokens after them: in the joint blocks the processor joins them, in the single blocks the model
has concatenated them already (``[registers + prompt, image piece]``), so both see the prompt tokens
before the rank's image tokens, and the image part of the keys and values is completed to the whole image.

Blocks. ``joint_transformer_blocks`` (returning prompt and image tokens), then
``single_transformer_blocks`` on their concatenation: one chain that ``asyncdiff`` cuts (declared through
:meth:`component_units`: the single blocks take no separate prompt argument, which a pipeline of stages
(:class:`BlockStack`) would need).
"""

from __future__ import annotations

from .base import ComponentUnits, PatchTokensFamily, require


class AuraFlowFamily(PatchTokensFamily):
    declares_components = True
    name = "auraflow"
    class_names = ("AuraFlowTransformer2DModel",)
    tokens_enter = "joint_transformer_blocks.0"
    attention_layers = ("joint_transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
    context_parallel = True
    context_parallel_sdpa = True
    context_parallel_text_arg = "encoder_hidden_states"
    joint_text_first = True

    def split_plan(self, model):
        require(
            len(model.joint_transformer_blocks) > 0,
            "AuraFlow without joint blocks is not supported by the displaced strategies (the image tokens are cut "
            "where they enter the first joint block)",
        )
        return super().split_plan(model)

    def component_units(self, model):
        names = [f"joint_transformer_blocks.{i}" for i in range(len(model.joint_transformer_blocks))]
        names += [f"single_transformer_blocks.{i}" for i in range(len(model.single_transformer_blocks))]
        return ComponentUnits(tuple((name, model.get_submodule(name)) for name in names), {})
