"""The VAE decoder (``AutoencoderKL``'s ``Decoder``), decoded in row bands on every rank.

At high resolution the decode costs as much as several denoising steps, and every rank would
otherwise repeat it. Its layers are the U-Net's kinds (3×3 convolutions, GroupNorm, one
self-attention), so the same banded layers apply; the decoder only up-samples, so any band of whole
latent rows stays aligned. The decode has no steps: it always exchanges fresh rows (exact).
"""

from __future__ import annotations

from .base import DenoiserFamily, Grid, slice_rows


class VAEDecoderFamily(DenoiserFamily):
    cuts_inputs = True
    name = "vae-decoder"
    class_names = ("Decoder",)
    latent_arg = "sample"
    timestep_arg = None
    output_dim = 2
    banded_spatial_layers = True
    whole_when_unsplittable = True  # e.g. a VAE tile whose rows do not divide by the rank count

    def grid(self, model, latent, inputs):
        return Grid(rows=latent.shape[-2], cols=latent.shape[-1])

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor

    def split_inputs(self, model, inputs, rows, grid):
        inputs[self.latent_arg] = slice_rows(inputs[self.latent_arg], 2, rows)
