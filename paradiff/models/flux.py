"""Flux.1 (``FluxTransformer2DModel``): packed latent tokens split by rows at the input.

Flux applies rotary position embeddings inside its attention processor, after projecting K/V, so
the image K/V can only be completed after the rotation: :class:`DisplacedFluxAttnProcessor` takes
the stock processor's steps (diffusers' own projection, norm, rotary and attention-dispatch helpers)
and completes the image part of K/V just before attention. The rotary table is sliced with the
image ids, so each rank's tokens keep their true positions.

A pipeline of stages (``pipefusion``) runs the double-stream ``transformer_blocks`` and then the
single-stream ``single_transformer_blocks`` as one sequence of blocks: both kinds take and return
the text and image tokens, and the rotary table is cut to the text plus the patch's tokens; the same
processor completes each patch's K/V from the layer's buffer of the whole image.

Under diffusers' context parallelism (``ulysses``/``ring``) Flux runs as diffusers ships it: the
class's own context-parallel plan (text and image tokens and their ids split at the input, ``proj_out``
gathered) and the stock ``FluxAttnProcessor``, which already routes attention through diffusers'
dispatcher.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

from ..compat import (
    ContextParallelInput,
    DispatchedAttentionProcessor,
    flux_qkv_projections,
    shipped_context_parallel_plan,
)
from ..errors import ParadiffError
from .base import BlockStack, DenoiserFamily, Grid, random_tokens, require, slice_rows


class FluxFamily(DenoiserFamily):
    cuts_inputs = True
    name = "flux"
    class_names = ("FluxTransformer2DModel",)
    prompt_embedder = "context_embedder"
    output_dim = 1
    #: Token positions, ``(tokens, 3)``: their length may equal the batch by chance, so never cut them.
    unbatched_args = ("img_ids", "txt_ids")
    token_residual_args = ("controlnet_block_samples", "controlnet_single_block_samples")
    context_parallel = True
    context_parallel_text_arg = "encoder_hidden_states"
    block_stack = BlockStack(
        lists=("transformer_blocks", "single_transformer_blocks"),
        text_arg="encoder_hidden_states",
        per_token={"image_rotary_emb": ContextParallelInput(split_dim=0)},
        unsupported_args=("controlnet_block_samples", "controlnet_single_block_samples"),
    )

    def block_inputs(self, model, image_tokens, text_tokens):
        width = model.inner_dim
        ids = torch.zeros(text_tokens + image_tokens, 3, device=model.device)
        return {
            "hidden_states": random_tokens(model, 1, image_tokens, width),
            "encoder_hidden_states": random_tokens(model, 1, text_tokens, width),
            "temb": random_tokens(model, 1, width),
            "image_rotary_emb": model.pos_embed(ids),
        }

    def grid(self, model, latent, inputs):
        ids = _image_ids(inputs)
        rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        require(
            rows * cols == latent.shape[1],
            f"img_ids describe a {rows}x{cols} grid but hidden_states hold {latent.shape[1]} tokens",
        )
        return Grid(rows=rows, cols=cols)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * 2  # Flux packs 2x2 latent pixels into one token

    def split_inputs(self, model, inputs, rows, grid):
        inputs["hidden_states"] = slice_rows(inputs["hidden_states"], 1, rows, grid.cols)
        ids = inputs["img_ids"]
        inputs["img_ids"] = slice_rows(ids, ids.ndim - 2, rows, grid.cols)

    def self_attention(self, model):
        return [(name, m) for name, m in model.named_modules() if isinstance(m, FluxAttention)]

    def context_parallel_plan(self, model):
        return shipped_context_parallel_plan(model)

    def context_parallel_processors(self, model):
        for name, attn in self.self_attention(model):
            if type(attn.processor) is not FluxAttnProcessor:
                raise ParadiffError(
                    f"Flux attention '{name}' uses {type(attn.processor).__name__}, which sequence parallelism "
                    "cannot run; supported: FluxAttnProcessor, the default "
                    "(transformer.set_attn_processor(FluxAttnProcessor()))"
                )
        return []

    def displaced_processor(self, attn, kv_factory):
        if type(attn.processor) is not FluxAttnProcessor:
            raise ParadiffError(
                f"Flux attention processor {type(attn.processor).__name__} is not supported by the patch and "
                "pipefusion strategies; supported: FluxAttnProcessor (call transformer.set_default_attn_processor() "
                "or unfuse_qkv_projections() first)"
            )
        return DisplacedFluxAttnProcessor(*kv_factory())


def _image_ids(inputs) -> torch.Tensor:
    ids = inputs["img_ids"]
    return ids[0] if ids.ndim == 3 else ids


class DisplacedFluxAttnProcessor(DispatchedAttentionProcessor):
    """Flux attention whose image keys/values are completed to the whole image after the rotary embedding.

    The rank's image tokens (its band, or the pipeline's current patch) are the last ``band_tokens`` of
    the (text + image) sequence in both the double-stream and the single-stream blocks.
    """

    def __init__(self, key, value):
        self.key, self.value = key, value

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise ParadiffError("Flux with an attention mask is not supported by the patch and pipefusion strategies")
        query, key, value, enc_query, enc_key, enc_value = flux_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            enc = (t.unflatten(-1, (-1, attn.head_dim)) for t in (enc_query, enc_key, enc_value))
            enc_query, enc_key, enc_value = enc
            enc_query, enc_key = attn.norm_added_q(enc_query), attn.norm_added_k(enc_key)
            query = torch.cat([enc_query, query], dim=1)
            key = torch.cat([enc_key, key], dim=1)
            value = torch.cat([enc_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        band = self.key.comm.state.partition.band_tokens
        text = key.shape[1] - band
        key = torch.cat([key[:, :text], self.key.complete(key[:, text:], token_dim=1)], dim=1)
        value = torch.cat([value[:, :text], self.value.complete(value[:, text:], token_dim=1)], dim=1)

        out = self.dispatch(query, key, value, parallel=False)
        if encoder_hidden_states is None:
            return out
        enc_out, out = out.split_with_sizes([encoder_hidden_states.shape[1], band], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(enc_out.contiguous())
