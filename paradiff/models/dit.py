"""DiTs with a patch embedding and absolute position embeddings (PixArt-α/Σ, SD3/3.5).

The patch embedding runs on the whole latent (so positions are right), its token output is cut to
the rank's rows, and the projection before un-patchifying is gathered back to the full sequence.
Joint attention (SD3) keeps the text tokens on every rank: only the image K/V are completed.

A pipeline of stages (``pipefusion``) runs the ``transformer_blocks`` in turn: PixArt's blocks take
the image tokens and attend to the prompt by cross-attention (a fixed input, whole on every patch);
SD3's joint blocks carry the text tokens along with the image tokens and return both.

Under diffusers' context parallelism (``ulysses``/``ring``) the same two places split and gather the
image tokens (diffusers ships no context-parallel plan for these classes, so the plan is declared here).
PixArt's cross-attention runs on each rank's own queries against the whole prompt, which is exact
without any exchange; SD3's joint attention mixes text and image, so its text tokens are split too.
The stock processors call PyTorch's attention themselves: that call is handed to diffusers'
dispatcher, which runs Ulysses or ring (``paradiff.layers.sdpa_dispatch``).
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import BlockStack, DenoiserFamily, Grid, random_tokens

#: Split a module's single ``(batch, tokens, channels)`` output along the tokens.
_SPLIT_TOKENS = {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)}


class PatchEmbedDiTFamily(DenoiserFamily):
    token_module = "pos_embed"
    output_module = "proj_out"
    output_dim = 1
    context_parallel = True
    #: The stock processors (``AttnProcessor2_0``, ``JointAttnProcessor2_0``) call PyTorch's attention themselves.
    context_parallel_sdpa = True
    #: Module whose output is the text token sequence, split under context parallelism; None: kept whole.
    text_module: str | None = None

    def grid(self, model, latent, inputs):
        patch = model.config.patch_size
        return Grid(rows=latent.shape[-2] // patch, cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * model.config.patch_size

    def context_parallel_plan(self, model):
        plan = {
            self.token_module: _SPLIT_TOKENS,
            self.output_module: ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
        if self.text_module:
            plan[self.text_module] = _SPLIT_TOKENS
        return plan


class PixArtFamily(PatchEmbedDiTFamily):
    name = "pixart"
    class_names = ("PixArtTransformer2DModel",)
    prompt_embedder = "caption_projection"
    block_stack = BlockStack(lists=("transformer_blocks",))

    def block_inputs(self, model, image_tokens, text_tokens):
        width = model.inner_dim
        return {
            "hidden_states": random_tokens(model, 1, image_tokens, width),
            "encoder_hidden_states": random_tokens(model, 1, text_tokens, width),
            "timestep": random_tokens(model, 1, 6 * width),  # the adaLN-single modulation
        }


class SD3Family(PatchEmbedDiTFamily):
    name = "sd3"
    class_names = ("SD3Transformer2DModel",)
    text_module = prompt_embedder = "context_embedder"
    context_parallel_text_arg = "encoder_hidden_states"
    token_residual_args = ("block_controlnet_hidden_states",)
    block_stack = BlockStack(
        lists=("transformer_blocks",),
        text_arg="encoder_hidden_states",
        unsupported_args=("block_controlnet_hidden_states", "skip_layers"),
    )

    def block_inputs(self, model, image_tokens, text_tokens):
        width = model.inner_dim
        return {
            "hidden_states": random_tokens(model, 1, image_tokens, width),
            "encoder_hidden_states": random_tokens(model, 1, text_tokens, model.config.caption_projection_dim),
            "temb": random_tokens(model, 1, width),
        }
