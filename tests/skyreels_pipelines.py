"""A tiny, offline SkyReels-V2 diffusion-forcing pipeline with random weights, for ``dualparal``'s tests and benchmark.

The transformer follows diffusers' ``tests/pipelines/skyreels_v2/test_skyreels_v2_df.py``
``get_dummy_components()`` (2 heads of 12, feed-forward 32), with ``layers`` blocks so that 2 or 4 stages
each get some; the VAE is the tiny Wan VAE of the tests. No text encoder: the call carries prompt
embeddings drawn from a seeded generator. The call runs the pipeline's asynchronous schedule:
``causal_block_size=2`` latent frames per block, ``ar_step=1`` (each block one level behind the one
before), CFG on (two calls per iteration), ``output_type="latent"``.
"""

from __future__ import annotations

import torch

#: Latent frames per causal block in the call.
BLOCK = 2
TEXT_TOKENS, TEXT_DIM = 16, 32


def build_df_pipeline(layers: int = 4, seed: int = 0, **transformer):
    """The pipeline; the same weights in every process (the caller's global RNG is left as it was)."""
    from diffusers import (
        AutoencoderKLWan,
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2Transformer3DModel,
        UniPCMultistepScheduler,
    )

    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        model = SkyReelsV2Transformer3DModel(**{**config, **transformer}).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=7.0)
    pipe = SkyReelsV2DiffusionForcingPipeline(
        tokenizer=None, text_encoder=None, vae=vae.eval(), scheduler=scheduler, transformer=model
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latent_frames_to_frames(latent_frames: int) -> int:
    """``num_frames`` of a video with ``latent_frames`` latent frames (the Wan VAE packs 4 frames into one)."""
    return (latent_frames - 1) * 4 + 1


def df_call(latent_frames: int = 8, size: int = 32, steps: int = 3, **extra) -> dict:
    """Arguments of a call of ``latent_frames`` latent frames at ``size`` px, seed 0, the whole video in one window
    (``extra`` overrides any)."""
    generator = torch.Generator().manual_seed(1)
    frames = latent_frames_to_frames(latent_frames)
    call = dict(
        prompt=None,
        prompt_embeds=torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=generator),
        negative_prompt_embeds=torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=generator),
        num_inference_steps=steps,
        guidance_scale=5.0,
        height=size,
        width=size,
        num_frames=frames,
        base_num_frames=frames,
        ar_step=1,
        causal_block_size=BLOCK,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    return {**call, **extra}
