"""A tiny CogVideoX pipeline folder with random weights that takes text prompts, for video end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel
from transformers import T5Config, T5EncoderModel

from paradiff.builtin.configs import build_tokenizer

TEXT_TOKENS = 226  # CogVideoXPipeline's default max_sequence_length


def build_tiny_cogvideox(seed: int = 0) -> CogVideoXPipeline:
    """The pipeline itself, in memory: the same weights in every process that builds it with the same seed."""
    torch.manual_seed(seed)
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
    vae = AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    pipe = CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )
    for module in (text_encoder, transformer, vae):
        module.eval()  # as from_pretrained leaves them: the T5 encoder's dropout off
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_cogvideox(folder: Path, seed: int = 0) -> Path:
    build_tiny_cogvideox(seed).save_pretrained(folder)
    return folder
