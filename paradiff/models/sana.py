"""Sana (``SanaTransformer2DModel``): a DiT with linear attention and a convolutional feed-forward, banded like a U-Net.

Sana's blocks keep the token grid's shape in mind: each block's feed-forward (``GLUMBConv``) folds the tokens
back into a ``rows × cols`` map and runs a depthwise 3x3 ``Conv2d`` over it, and the model computes that
height from its input latent. So the latent is cut into row bands at the input (the model then computes the
band's height itself), the 3x3 convolutions get halo rows from the neighbouring bands, and the output —
un-patchified by the model to ``(batch, channels, band rows, cols)`` — is gathered along the rows.

The self-attention (``attn1``, ``SanaLinearAttnProcessor2_0``) is linear: no softmax, but each query still
reads the sum over every token of ``relu(k) ⊗ v``; completing the keys and values of ``attn.to_k`` /
``attn.to_v`` to the whole image (hooks on the two projections, as for U-Nets) makes a band's queries exact.
Its per-token key norm (``qk_norm``) runs after the projection on the completed keys. The cross-attention
(``attn2``) reads the prompt, whole on every rank.

Position embeddings: Sana's configs have none (``interpolation_scale`` unset, so ``patch_embed.pos_embed`` is
None). With them the patch embedding would place a band's tokens at the top of the image, so such a model
is refused.

Cut into components (``asyncdiff``) Sana is its chain of ``transformer_blocks``; a pipeline of stages
(``pipefusion``) is not offered, as its blocks fold a whole image's tokens into the grid.
"""

from __future__ import annotations

from .base import ComponentUnits, DenoiserFamily, Grid, require, slice_rows


class SanaFamily(DenoiserFamily):
    declares_components = True
    cuts_inputs = True
    name = "sana"
    class_names = ("SanaTransformer2DModel",)
    output_dim = 2
    #: The feed-forward's depthwise 3x3 convolutions see row bands of the token grid (Sana has no GroupNorm).
    banded_spatial_layers = True

    def grid(self, model, latent, inputs):
        _require_no_positions(model)
        return Grid(rows=latent.shape[-2], cols=latent.shape[-1])

    def row_multiple(self, model):
        return model.config.patch_size

    def split_inputs(self, model, inputs, rows, grid):
        inputs[self.latent_arg] = slice_rows(inputs[self.latent_arg], 2, rows)
        samples = inputs.get("controlnet_block_samples")
        if samples is not None:  # tokens of the whole grid, added after blocks: cut to the band's tokens
            patch = model.config.patch_size
            token_rows, cols = slice(rows.start // patch, rows.stop // patch), grid.cols // patch
            inputs["controlnet_block_samples"] = type(samples)(slice_rows(t, 1, token_rows, cols) for t in samples)

    def self_attention(self, model):
        _require_no_positions(model)
        return super().self_attention(model)

    def component_units(self, model):
        units = tuple((f"transformer_blocks.{i}", block) for i, block in enumerate(model.transformer_blocks))
        return ComponentUnits(units, {}, ("controlnet_block_samples",))


def _require_no_positions(model) -> None:
    require(
        getattr(model.patch_embed, "pos_embed", None) is None,
        f"{type(model).__name__} with position embeddings (patch_embed.pos_embed, set by interpolation_scale) is not "
        "supported by the patch strategy: the patch embedding would give each row band the positions of the image's "
        "top rows",
    )
