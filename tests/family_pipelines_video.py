"""Tiny, offline diffusers video pipelines with random weights, one per family, for multi-rank tests.

``build_video_pipeline(name, seed)`` builds the denoiser, VAE, scheduler (and, for SVD, a tiny CLIP image encoder)
from small configs under ``torch.manual_seed(seed)``, so every process that builds the same family with the same seed
gets bit-identical weights; the caller's global RNG state is left as it was. Text encoders are left out: the call
kwargs carry prompt embeddings (and masks, pooled embeddings) drawn from a seeded ``torch.Generator``, so no pipeline
touches a tokenizer or a text encoder. ``pipe(**kwargs)`` runs the whole pipeline on CPU in about a second or less,
with classifier-free guidance on (HunyuanVideo: ``true_cfg_scale``; SVD: its per-frame guidance ramp), 3 steps, and
``output_type="latent"``: ``pipe(**kwargs).frames`` is the final latents, of shape ``OUTPUT_SHAPES[name]`` (LTX
returns them packed as tokens, ``(batch, frames*rows*cols, channels)``).

The configs follow diffusers' own ``tests/pipelines/<family>/test_*.py`` ``get_dummy_components()``, resized so that
the denoiser's token grid has 4 (or 8) rows and an even number of columns (rows split over 2 or 4 ranks), 2 or 4
latent frames, head counts divisible by 2 (4 where cheap) and ``TEXT_TOKENS`` (divisible by 4) prompt tokens.

Run ``python tests/family_pipelines_video.py [family ...]`` to build and run each one twice and check it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from diffusers import DiffusionPipeline

VIDEO_FAMILIES = ("wan", "cogvideox", "hunyuanvideo", "ltx", "mochi", "latte", "allegro", "animatediff", "svd")

#: ``pipe(**kwargs).frames.shape`` per family (latents; batch 1).
OUTPUT_SHAPES = {
    "wan": (1, 16, 2, 8, 8),  # [B, C, F, H, W]
    "cogvideox": (1, 2, 4, 8, 8),  # [B, F, C, H, W]
    "hunyuanvideo": (1, 4, 2, 4, 4),  # [B, C, F, H, W]
    "ltx": (1, 2 * 8 * 8, 8),  # packed [B, F*H*W, C]
    "mochi": (1, 12, 2, 8, 8),  # [B, C, F, H, W]
    "latte": (1, 4, 2, 8, 8),  # [B, C, F, H, W]
    "allegro": (1, 4, 2, 8, 8),  # [B, C, F, H, W]
    "animatediff": (1, 4, 4, 8, 8),  # [B, C, F, H, W]
    "svd": (1, 4, 4, 8, 8),  # [B, F, C, H, W]
}

#: Prompt tokens in every text-conditioned pipeline (divisible by 4).
TEXT_TOKENS = 16
#: Of which the prompt attention masks mark the first ``VALID_TOKENS`` as real and the rest as padding, as a
#: tokenizer padding to ``max_sequence_length`` would (only for pipelines that take a mask).
VALID_TOKENS = 12
#: The generator seed of the call kwargs (initial noise).
CALL_SEED = 0
NUM_INFERENCE_STEPS = 3


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` inside, the caller's global RNG state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _mask(batch: int = 1) -> torch.Tensor:
    mask = torch.zeros(batch, TEXT_TOKENS, dtype=torch.long)
    mask[:, :VALID_TOKENS] = 1
    return mask


def _prompts(generator: torch.Generator, width: int, masked: bool = False) -> dict:
    """A prompt's and a negative prompt's embeddings (``TEXT_TOKENS`` of ``width``), with their masks if ``masked``."""
    kwargs = {
        "prompt_embeds": _randn(generator, 1, TEXT_TOKENS, width),
        "negative_prompt_embeds": _randn(generator, 1, TEXT_TOKENS, width),
    }
    if masked:
        kwargs |= {"prompt_attention_mask": _mask(), "negative_prompt_attention_mask": _mask()}
    return kwargs


def _common(**kwargs) -> dict:
    return dict(
        generator=torch.Generator().manual_seed(CALL_SEED),
        num_inference_steps=NUM_INFERENCE_STEPS,
        output_type="latent",
        **kwargs,
    )


# --------------------------------------------------------------------------------------------------------------------
# Wan 2.1 text-to-video: WanTransformer3DModel, patch (1, 2, 2); VAE 8x spatial, 4x temporal.
# 64x64 px, 5 frames -> latents (1, 16, 2, 8, 8) -> tokens 2 frames x 4 rows x 4 cols.
def _build_wan(seed: int) -> tuple:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=transformer,
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 32),
        guidance_scale=5.0,
        height=64,
        width=64,
        num_frames=5,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# CogVideoX(-5b) text-to-video: CogVideoXTransformer3DModel, patch 2, 3D RoPE; VAE 8x spatial, 4x temporal.
# 64x64 px, 5 frames -> latents (1, 2, 4, 8, 8) [B, F, C, H, W] -> tokens 2 x 4 x 4, after 16 text tokens.
def _build_cogvideox(seed: int) -> tuple:
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=16,  # the 3D RoPE splits it 4 (frames) + 6 (rows) + 6 (cols)
        in_channels=4,
        out_channels=4,
        time_embed_dim=4,
        text_embed_dim=32,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=TEXT_TOKENS,
        use_rotary_positional_embeddings=True,  # as CogVideoX-5b and 1.5 (2b: sincos positions instead)
    )
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    pipe = CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=CogVideoXDDIMScheduler()
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 32),
        guidance_scale=6.0,
        height=64,
        width=64,
        num_frames=5,
        max_sequence_length=TEXT_TOKENS,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# HunyuanVideo text-to-video: HunyuanVideoTransformer3DModel (dual- then single-stream blocks), patch 1; VAE 8x
# spatial, 4x temporal. 32x32 px, 5 frames -> latents (1, 4, 2, 4, 4) -> tokens 2 x 4 x 4, then 16 text tokens.
# Guidance-distilled: ``guidance_scale`` is embedded; real CFG is ``true_cfg_scale`` > 1 with negative embeddings.
def _build_hunyuanvideo(seed: int) -> tuple:
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    )
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    pipe = HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        prompt_embeds=_randn(gen, 1, TEXT_TOKENS, 16),
        pooled_prompt_embeds=_randn(gen, 1, 8),
        prompt_attention_mask=_mask(),
        negative_prompt_embeds=_randn(gen, 1, TEXT_TOKENS, 16),
        negative_pooled_prompt_embeds=_randn(gen, 1, 8),
        negative_prompt_attention_mask=_mask(),
        true_cfg_scale=4.0,
        guidance_scale=6.0,
        height=32,
        width=32,
        num_frames=5,
        max_sequence_length=TEXT_TOKENS,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# LTX-Video text-to-video: LTXVideoTransformer3DModel, patch 1; this VAE 4x spatial, 4x temporal (the real one 32x, 8x;
# the pipeline wants multiples of 32 px). 32x32 px, 5 frames -> latents packed to (1, 2*8*8, 8) -> tokens 2 x 8 x 8.
def _build_ltx(seed: int) -> tuple:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=32,
    )
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 32, masked=True),
        guidance_scale=3.0,
        height=32,
        width=32,
        num_frames=5,
        max_sequence_length=TEXT_TOKENS,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# Mochi 1 text-to-video: MochiTransformer3DModel (asymmetric joint attention), patch 2; VAE 8x spatial, 6x temporal.
# 64x64 px, 7 frames -> latents (1, 12, 2, 8, 8) -> tokens 2 x 4 x 4, then 16 text tokens.
def _build_mochi(seed: int) -> tuple:
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    transformer = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=4,
        attention_head_dim=8,
        num_layers=2,
        pooled_projection_dim=16,
        in_channels=12,
        out_channels=None,
        qk_norm="rms_norm",
        text_embed_dim=32,
        time_embed_dim=4,
        activation_fn="swiglu",
        max_sequence_length=TEXT_TOKENS,
    )
    # Learned RoPE frequencies, initialised to 0 (RoPE = identity): make them non-trivial.
    transformer.pos_frequencies.data = torch.randn(transformer.pos_frequencies.shape) * 0.5
    vae = AutoencoderKLMochi(
        latent_channels=12,
        out_channels=3,
        encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
    )
    pipe = MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 32, masked=True),
        guidance_scale=4.5,
        height=64,
        width=64,
        num_frames=7,
        max_sequence_length=TEXT_TOKENS,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# Latte text-to-video: LatteTransformer3DModel (spatial + temporal blocks), patch 2; a 2D VAE with no downscale (as in
# diffusers' test; the real one 8x). 8x8 px, 2 frames -> latents (1, 4, 2, 8, 8) -> tokens 2 x 4 x 4.
def _build_latte(seed: int) -> tuple:
    from diffusers import AutoencoderKL, DDIMScheduler, LattePipeline, LatteTransformer3DModel

    transformer = LatteTransformer3DModel(
        sample_size=8,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=32,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        video_length=2,
    )
    vae = AutoencoderKL()
    pipe = LattePipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=DDIMScheduler(clip_sample=False)
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 32),
        guidance_scale=5.0,
        height=8,
        width=8,
        video_length=2,
        negative_prompt=None,  # the default "" would clash with negative_prompt_embeds
        clean_caption=False,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# Allegro text-to-video: AllegroTransformer3DModel, patch 2, 3D RoPE; VAE 8x spatial, 4x temporal.
# 64x64 px, 8 frames -> latents (1, 4, 2, 8, 8) -> tokens 2 x 4 x 4.
def _build_allegro(seed: int) -> tuple:
    from diffusers import AllegroPipeline, AllegroTransformer3DModel, AutoencoderKLAllegro, DDIMScheduler

    transformer = AllegroTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=48,
        sample_width=8,
        sample_height=8,
        sample_frames=2,
        caption_channels=32,
    )
    vae = AutoencoderKLAllegro(
        in_channels=3,
        out_channels=3,
        down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    vae.enable_tiling()  # diffusers' Allegro VAE only decodes tiled
    # no x0 clipping: at ±1 it amplifies float round-off ~100x per step (see family_pipelines_image's HunyuanDiT)
    pipe = AllegroPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=transformer,
        scheduler=DDIMScheduler(clip_sample=False),
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 32, masked=True),
        guidance_scale=6.0,
        height=64,
        width=64,
        num_frames=8,
        max_sequence_length=TEXT_TOKENS,
        negative_prompt=None,  # the default "" would clash with negative_prompt_embeds
        clean_caption=False,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# AnimateDiff: UNetMotionModel = a tiny SD U-Net + MotionAdapter (temporal transformers); 2D VAE 2x.
# 16x16 px, 4 frames -> latents (1, 4, 4, 8, 8); the U-Net sees (B*F, C, 8, 8), then (B*F, C, 4, 4).
def _build_animatediff(seed: int) -> tuple:
    from diffusers import AnimateDiffPipeline, AutoencoderKL, DDIMScheduler, MotionAdapter, UNet2DConditionModel

    block_out_channels = (16, 16)
    unet = UNet2DConditionModel(
        block_out_channels=block_out_channels,
        layers_per_block=2,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=4,  # diffusers' legacy name: the number of heads
        norm_num_groups=2,
    )
    vae = AutoencoderKL(
        block_out_channels=block_out_channels,
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        norm_num_groups=2,
    )
    motion_adapter = MotionAdapter(
        block_out_channels=block_out_channels,
        motion_layers_per_block=2,
        motion_norm_num_groups=2,
        motion_num_attention_heads=4,
    )
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear", clip_sample=False)
    pipe = AnimateDiffPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        motion_adapter=motion_adapter,
        scheduler=scheduler,
        feature_extractor=None,
        image_encoder=None,
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = _common(
        **_prompts(gen, 8),
        guidance_scale=7.5,
        height=16,
        width=16,
        num_frames=4,
    )
    return pipe, kwargs


# --------------------------------------------------------------------------------------------------------------------
# Stable Video Diffusion image-to-video: UNetSpatioTemporalConditionModel; AutoencoderKLTemporalDecoder 2x; a tiny
# CLIP image encoder (the pipeline resizes the image to 224 px for it). 16x16 px, 4 frames -> latents (1, 4, 4, 8, 8)
# [B, F, C, H, W]; the U-Net concatenates the image latents (8 channels in) and sees 8x8 then 4x4 per frame.
def _build_svd(seed: int) -> tuple:
    import numpy as np
    from diffusers import (
        AutoencoderKLTemporalDecoder,
        EulerDiscreteScheduler,
        StableVideoDiffusionPipeline,
        UNetSpatioTemporalConditionModel,
    )
    from PIL import Image
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    try:
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor  # no torchvision needed
    except ImportError:
        from transformers import CLIPImageProcessor

    unet = UNetSpatioTemporalConditionModel(
        block_out_channels=(32, 32),  # its GroupNorms have 32 groups
        layers_per_block=1,
        sample_size=8,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        cross_attention_dim=32,
        num_attention_heads=4,
        projection_class_embeddings_input_dim=96,
        addition_time_embed_dim=32,
    )
    vae = AutoencoderKLTemporalDecoder(
        block_out_channels=[32, 32],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        latent_channels=4,
        layers_per_block=1,
    )
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=32,
            projection_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=224,
            intermediate_size=37,
            patch_size=32,
        )
    ).eval()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        interpolation_type="linear",
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        sigma_max=700.0,
        sigma_min=0.002,
        steps_offset=1,
        timestep_spacing="leading",
        timestep_type="continuous",
        use_karras_sigmas=True,
    )
    pipe = StableVideoDiffusionPipeline(
        vae=vae,
        image_encoder=image_encoder,
        unet=unet,
        scheduler=scheduler,
        feature_extractor=CLIPImageProcessor(crop_size=224, size=224),
    )
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(16, 16, 3, generator=gen) * 255).to(torch.uint8).numpy()
    kwargs = _common(
        image=Image.fromarray(np.ascontiguousarray(pixels)),
        min_guidance_scale=1.0,
        max_guidance_scale=2.5,
        height=16,
        width=16,
        num_frames=4,
        decode_chunk_size=4,
    )
    return pipe, kwargs


_BUILDERS: dict[str, Callable[[int], tuple]] = {
    "wan": _build_wan,
    "cogvideox": _build_cogvideox,
    "hunyuanvideo": _build_hunyuanvideo,
    "ltx": _build_ltx,
    "mochi": _build_mochi,
    "latte": _build_latte,
    "allegro": _build_allegro,
    "animatediff": _build_animatediff,
    "svd": _build_svd,
}


def build_video_pipeline(name: str, seed: int = 0) -> tuple[DiffusionPipeline, dict]:
    """(pipe, call kwargs): ``pipe(**kwargs)`` runs the whole pipeline offline on CPU in about a second or less.

    The kwargs hold a fresh ``torch.Generator`` for the initial noise: build them again (or re-seed it) for a second
    call. ``pipe(**kwargs).frames`` is the output latents.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown video family {name!r}: one of {', '.join(VIDEO_FAMILIES)}")
    with _seeded(seed):  # the pipelines' own __init__ may draw too (AnimateDiff builds its UNetMotionModel there)
        pipe, kwargs = _BUILDERS[name](seed)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe, kwargs


def _check(names: list[str]) -> None:
    import time

    torch.set_num_threads(1)
    for name in names:
        outputs, seconds = [], []
        for _ in range(2):
            start = time.perf_counter()
            pipe, kwargs = build_video_pipeline(name)
            built = time.perf_counter()
            with torch.no_grad():
                out = pipe(**kwargs).frames
            seconds.append((built - start, time.perf_counter() - built))
            outputs.append(out)
        out = outputs[0]
        assert torch.isfinite(out).all(), name
        assert torch.equal(outputs[0], outputs[1]), name
        assert tuple(out.shape) == OUTPUT_SHAPES[name], (name, tuple(out.shape))
        denoiser = getattr(pipe, "transformer", None) or pipe.unet
        print(
            f"{name:13s} {type(pipe).__name__:30s} {type(denoiser).__name__:34s} out {tuple(out.shape)}"
            + "".join(f"  build {b:.2f}s run {r:.2f}s" for b, r in seconds)
        )


if __name__ == "__main__":
    import sys

    _check(sys.argv[1:] or list(VIDEO_FAMILIES))
