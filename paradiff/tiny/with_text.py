"""A tiny CogVideoX pipeline that reads text prompts: a real (tiny) T5 text encoder and tokenizer, random weights.

The other tiny pipelines skip the text encoder; this one keeps it so that a folder saved from it
(``save_pretrained``) loads through diffusers' own ``from_pretrained`` path and takes a prompt, as a user's
model would. Its tokenizer is paradiff-tiny's word-level one.
"""

from __future__ import annotations

import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel, DiffusionPipeline
from transformers import T5Config, T5EncoderModel

from ..builtin.configs import build_tokenizer
from .parts import cogvideox_vae

TEXT_TOKENS = 226  # CogVideoXPipeline's default max_sequence_length


def cogvideox() -> CogVideoXPipeline:
    tokenizer = build_tokenizer()
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    )
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=32,
        num_layers=1,
        sample_width=4,
        sample_height=4,
        sample_frames=5,
        max_text_seq_length=TEXT_TOKENS,
    )
    return CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=cogvideox_vae(),
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )


def cogvideox_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    """A prompt in words the tokenizer knows, 5 frames of 32 px (2 latent frames of 4 x 4)."""
    return {"prompt": "a red circle", "num_frames": 5, "height": 32, "width": 32}
