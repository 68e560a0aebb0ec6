"""Tiny video pipelines of nine families, with random weights: Wan, CogVideoX, HunyuanVideo, LTX-Video, Mochi, Latte,
Allegro, AnimateDiff and Stable Video Diffusion.

The denoiser, VAE, scheduler (and, for SVD, a tiny CLIP image encoder) come from small configs that follow diffusers'
own ``tests/pipelines/<family>/test_*.py`` ``get_dummy_components()``, resized so that the denoiser's token grid has 4
(or 8) rows and an even number of columns (rows split over 2 or 4 ranks), 2 or 4 latent frames, head counts divisible
by 2 (4 where cheap) and ``TEXT_TOKENS`` (divisible by 4) prompt tokens. Text encoders are left out: the call carries
prompt embeddings (and masks, pooled embeddings), so no pipeline touches a tokenizer or a text encoder. The calls run
classifier-free guidance (HunyuanVideo: ``true_cfg_scale``; SVD: its per-frame guidance ramp), and
``pipe(**kwargs).frames`` is the final latents, of the shape each family's comment gives (LTX returns them packed as
tokens, ``(batch, frames*rows*cols, channels)``).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import (
    AllegroPipeline,
    AllegroTransformer3DModel,
    AnimateDiffPipeline,
    AutoencoderKL,
    AutoencoderKLAllegro,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLLTXVideo,
    AutoencoderKLMochi,
    AutoencoderKLTemporalDecoder,
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    LattePipeline,
    LatteTransformer3DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    MochiPipeline,
    MochiTransformer3DModel,
    MotionAdapter,
    StableVideoDiffusionPipeline,
    UNet2DConditionModel,
    UNetSpatioTemporalConditionModel,
    WanPipeline,
    WanTransformer3DModel,
)
from PIL import Image
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from .parts import WAN_DIT, cogvideox_vae, embeddings, kl_vae, mask, prompt_pair, video_vae, wan_vae

try:
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor  # no torchvision needed
except ImportError:
    from transformers import CLIPImageProcessor

#: Prompt tokens in every text-conditioned pipeline (divisible by 4).
TEXT_TOKENS = 16
#: Of which the prompt attention masks mark the first ``VALID_TOKENS`` as real and the rest as padding, as a
#: tokenizer padding to ``max_sequence_length`` would (only for pipelines that take a mask).
VALID_TOKENS = 12


def _prompts(generator: torch.Generator, width: int, masked: bool = False) -> dict:
    """A prompt's and a negative prompt's embeddings (``TEXT_TOKENS`` of ``width``), with their masks if ``masked``."""
    kwargs = prompt_pair(generator, TEXT_TOKENS, width)
    if masked:
        kwargs |= {"prompt_attention_mask": _mask(), "negative_prompt_attention_mask": _mask()}
    return kwargs


def _mask() -> torch.Tensor:
    return mask(VALID_TOKENS, TEXT_TOKENS)


# --------------------------------------------------------------------------------------------------------------------
# Wan 2.1 text-to-video: WanTransformer3DModel, patch (1, 2, 2); VAE 8x spatial, 4x temporal.
# 64x64 px, 5 frames -> latents (1, 16, 2, 8, 8) -> tokens 2 frames x 4 rows x 4 cols.
def wan() -> WanPipeline:
    vae = wan_vae()
    transformer = WanTransformer3DModel(
        **WAN_DIT, num_attention_heads=4, attention_head_dim=8, num_layers=2, rope_max_seq_len=32
    )
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=transformer,
    )


def wan_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 32),
        guidance_scale=5.0,
        height=64,
        width=64,
        num_frames=5,
    )


# --------------------------------------------------------------------------------------------------------------------
# CogVideoX(-5b) text-to-video: CogVideoXTransformer3DModel, patch 2, 3D RoPE; VAE 8x spatial, 4x temporal.
# 64x64 px, 5 frames -> latents (1, 2, 4, 8, 8) [B, F, C, H, W] -> tokens 2 x 4 x 4, after 16 text tokens.
def cogvideox() -> CogVideoXPipeline:
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
    vae = cogvideox_vae()
    return CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=CogVideoXDDIMScheduler()
    )


def cogvideox_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 32),
        guidance_scale=6.0,
        height=64,
        width=64,
        num_frames=5,
        max_sequence_length=TEXT_TOKENS,
    )


# --------------------------------------------------------------------------------------------------------------------
# HunyuanVideo text-to-video: HunyuanVideoTransformer3DModel (dual- then single-stream blocks), patch 1; VAE 8x
# spatial, 4x temporal. 32x32 px, 5 frames -> latents (1, 4, 2, 4, 4) -> tokens 2 x 4 x 4, then 16 text tokens.
# Guidance-distilled: ``guidance_scale`` is embedded; real CFG is ``true_cfg_scale`` > 1 with negative embeddings.
def hunyuanvideo() -> HunyuanVideoPipeline:
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
    vae = video_vae(
        AutoencoderKLHunyuanVideo,
        "HunyuanVideo",
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
    return HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )


def hunyuanvideo_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        prompt_embeds=embeddings(g, TEXT_TOKENS, 16),
        pooled_prompt_embeds=torch.randn(1, 8, generator=g),
        prompt_attention_mask=_mask(),
        negative_prompt_embeds=embeddings(g, TEXT_TOKENS, 16),
        negative_pooled_prompt_embeds=torch.randn(1, 8, generator=g),
        negative_prompt_attention_mask=_mask(),
        true_cfg_scale=4.0,
        guidance_scale=6.0,
        height=32,
        width=32,
        num_frames=5,
        max_sequence_length=TEXT_TOKENS,
    )


# --------------------------------------------------------------------------------------------------------------------
# LTX-Video text-to-video: LTXVideoTransformer3DModel, patch 1; this VAE 4x spatial, 4x temporal (the real one 32x, 8x;
# the pipeline wants multiples of 32 px). 32x32 px, 5 frames -> latents packed to (1, 2*8*8, 8) -> tokens 2 x 8 x 8.
def ltx() -> LTXPipeline:
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
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )


def ltx_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 32, masked=True),
        guidance_scale=3.0,
        height=32,
        width=32,
        num_frames=5,
        max_sequence_length=TEXT_TOKENS,
    )


# --------------------------------------------------------------------------------------------------------------------
# Mochi 1 text-to-video: MochiTransformer3DModel (asymmetric joint attention), patch 2; VAE 8x spatial, 6x temporal.
# 64x64 px, 7 frames -> latents (1, 12, 2, 8, 8) -> tokens 2 x 4 x 4, then 16 text tokens.
def mochi() -> MochiPipeline:
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
    return MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )


def mochi_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 32, masked=True),
        guidance_scale=4.5,
        height=64,
        width=64,
        num_frames=7,
        max_sequence_length=TEXT_TOKENS,
    )


# --------------------------------------------------------------------------------------------------------------------
# Latte text-to-video: LatteTransformer3DModel (spatial + temporal blocks), patch 2; a 2D VAE with no downscale (as in
# diffusers' test; the real one 8x). 8x8 px, 2 frames -> latents (1, 4, 2, 8, 8) -> tokens 2 x 4 x 4.
def latte() -> LattePipeline:
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
    return LattePipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=DDIMScheduler(clip_sample=False)
    )


def latte_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 32),
        guidance_scale=5.0,
        height=8,
        width=8,
        video_length=2,
        negative_prompt=None,  # the default "" would clash with negative_prompt_embeds
        clean_caption=False,
    )


# --------------------------------------------------------------------------------------------------------------------
# Allegro text-to-video: AllegroTransformer3DModel, patch 2, 3D RoPE; VAE 8x spatial, 4x temporal.
# 64x64 px, 8 frames -> latents (1, 4, 2, 8, 8) -> tokens 2 x 4 x 4.
def allegro() -> AllegroPipeline:
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
    vae = video_vae(AutoencoderKLAllegro, "Allegro", norm_num_groups=2, temporal_compression_ratio=4)
    vae.enable_tiling()  # diffusers' Allegro VAE only decodes tiled
    # no x0 clipping: at ±1 it amplifies float round-off ~100x per step (see image_dits' HunyuanDiT)
    return AllegroPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=transformer,
        scheduler=DDIMScheduler(clip_sample=False),
    )


def allegro_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 32, masked=True),
        guidance_scale=6.0,
        height=64,
        width=64,
        num_frames=8,
        max_sequence_length=TEXT_TOKENS,
        negative_prompt=None,  # the default "" would clash with negative_prompt_embeds
        clean_caption=False,
    )


# --------------------------------------------------------------------------------------------------------------------
# AnimateDiff: UNetMotionModel = a tiny SD U-Net + MotionAdapter (temporal transformers); 2D VAE 2x.
# 16x16 px, 4 frames -> latents (1, 4, 4, 8, 8); the U-Net sees (B*F, C, 8, 8), then (B*F, C, 4, 4).
def animatediff() -> AnimateDiffPipeline:
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
    vae = kl_vae(block_out_channels, latent_channels=4, norm_num_groups=2)
    motion_adapter = MotionAdapter(
        block_out_channels=block_out_channels,
        motion_layers_per_block=2,
        motion_norm_num_groups=2,
        motion_num_attention_heads=4,
    )
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear", clip_sample=False)
    return AnimateDiffPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        motion_adapter=motion_adapter,
        scheduler=scheduler,
        feature_extractor=None,
        image_encoder=None,
    )


def animatediff_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_prompts(g, 8),
        guidance_scale=7.5,
        height=16,
        width=16,
        num_frames=4,
    )


# --------------------------------------------------------------------------------------------------------------------
# Stable Video Diffusion image-to-video: UNetSpatioTemporalConditionModel; AutoencoderKLTemporalDecoder 2x; a tiny
# CLIP image encoder (the pipeline resizes the image to 224 px for it). 16x16 px, 4 frames -> latents (1, 4, 4, 8, 8)
# [B, F, C, H, W]; the U-Net concatenates the image latents (8 channels in) and sees 8x8 then 4x4 per frame.
def svd() -> StableVideoDiffusionPipeline:
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
    return StableVideoDiffusionPipeline(
        vae=vae,
        image_encoder=image_encoder,
        unet=unet,
        scheduler=scheduler,
        feature_extractor=CLIPImageProcessor(crop_size=224, size=224),
    )


def svd_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    pixels = (torch.rand(16, 16, 3, generator=g) * 255).to(torch.uint8).numpy()
    return dict(
        image=Image.fromarray(np.ascontiguousarray(pixels)),
        min_guidance_scale=1.0,
        max_guidance_scale=2.5,
        height=16,
        width=16,
        num_frames=4,
        decode_chunk_size=4,
    )
