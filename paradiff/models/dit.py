"""DiTs with a patch embedding and absolute position embeddings (PixArt-α/Σ, SD3/3.5).

The patch embedding runs on the whole latent (so positions are right), its token output is cut to
the rank's rows, and the projection before un-patchifying is gathered back to the full sequence.
Joint attention (SD3) keeps the text tokens on every rank: only the image K/V are completed.
"""

from __future__ import annotations

from .base import DenoiserFamily, Grid


class PatchEmbedDiTFamily(DenoiserFamily):
    token_module = "pos_embed"
    output_module = "proj_out"
    output_dim = 1

    def grid(self, model, latent, inputs):
        patch = model.config.patch_size
        return Grid(rows=latent.shape[-2] // patch, cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size


class PixArtFamily(PatchEmbedDiTFamily):
    name = "pixart"
    class_names = ("PixArtTransformer2DModel",)


class SD3Family(PatchEmbedDiTFamily):
    name = "sd3"
    class_names = ("SD3Transformer2DModel",)
