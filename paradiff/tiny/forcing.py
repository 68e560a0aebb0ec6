"""A tiny SkyReels-V2 diffusion-forcing pipeline with random weights, for ``dualparal``.

The transformer follows diffusers' ``tests/pipelines/skyreels_v2/test_skyreels_v2_df.py``
``get_dummy_components()`` (2 heads of 12, feed-forward 32), with ``layers`` blocks so that 2 or 4 stages
each get some; the VAE is the tiny Wan VAE. No text encoder: the call carries prompt embeddings. The call
runs the pipeline's asynchronous schedule: ``causal_block_size=2`` latent frames per block, ``ar_step=1``
(each block one level behind the one before), CFG on (two calls per iteration), ``output_type="latent"``.
"""

from __future__ import annotations

import torch
from diffusers import (
    DiffusionPipeline,
    SkyReelsV2DiffusionForcingPipeline,
    SkyReelsV2Transformer3DModel,
    UniPCMultistepScheduler,
)

from .parts import NOISE_SEED, WAN_DIT, prompt_pair, wan_vae

#: Latent frames per causal block in the call.
BLOCK = 2
TEXT_TOKENS = 16
TEXT_DIM = WAN_DIT["text_dim"]
#: The seed of :func:`df_call`'s prompt embeddings unless it is given a generator.
PROMPT_SEED = 1


def pipeline(layers: int = 4, **transformer) -> SkyReelsV2DiffusionForcingPipeline:
    """The pipeline with ``layers`` transformer blocks (``transformer`` overrides any of its config)."""
    config = dict(WAN_DIT, num_attention_heads=2, attention_head_dim=12, num_layers=layers, rope_max_seq_len=64)
    vae = wan_vae()
    model = SkyReelsV2Transformer3DModel(**{**config, **transformer})
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=7.0)
    return SkyReelsV2DiffusionForcingPipeline(
        tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=model
    )


def latent_frames_to_frames(latent_frames: int) -> int:
    """``num_frames`` of a video with ``latent_frames`` latent frames (the Wan VAE packs 4 frames into one)."""
    return (latent_frames - 1) * 4 + 1


def df_call(
    latent_frames: int = 8, size: int = 32, steps: int = 3, prompts: torch.Generator | None = None, **extra
) -> dict:
    """Arguments of a call of ``latent_frames`` latent frames at ``size`` px, the whole video in one window, noise
    seed 0, prompt embeddings from ``prompts`` (a generator seeded ``PROMPT_SEED`` if None); ``extra`` overrides any."""
    frames = latent_frames_to_frames(latent_frames)
    generator = torch.Generator().manual_seed(PROMPT_SEED) if prompts is None else prompts
    call = dict(
        prompt=None,
        **prompt_pair(generator, TEXT_TOKENS, TEXT_DIM),
        num_inference_steps=steps,
        guidance_scale=5.0,
        height=size,
        width=size,
        num_frames=frames,
        base_num_frames=frames,
        ar_step=1,
        causal_block_size=BLOCK,
        output_type="latent",
        generator=torch.Generator().manual_seed(NOISE_SEED),
    )
    return {**call, **extra}


def call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    """The table's call: :func:`df_call`'s defaults, the prompt embeddings drawn from ``g``."""
    return df_call(prompts=g)
