"""Tiny image DiT pipelines of eight more families, with random weights: Sana, Hunyuan-DiT, Lumina2, AuraFlow,
CogView4, Qwen-Image, Chroma and Flux.2.

The denoiser, VAE and scheduler are built from small configs (modelled on diffusers' own ``tests/pipelines/<family>``
dummy components); no text encoder or tokenizer is built: the call carries prompt embeddings (and masks, where the
pipeline takes them) and the pipelines are given ``tokenizer=None, text_encoder=None``.

Common shape of every family: the denoiser sees an image token grid of ``TOKEN_ROWS x TOKEN_COLS`` = 8 x 4 tokens
(after VAE downscale and patchify/packing), prompts of ``PROMPT_TOKENS`` = 16 tokens, attention head counts divisible
by 4, and CFG on wherever the pipeline has it (Flux2Pipeline is guidance-distilled and has none).

Masks: the positive prompt's mask is all ones; the negative prompt's mask (where the pipeline takes one) has its last
``NEGATIVE_PAD_TOKENS`` = 4 tokens masked out, as a shorter negative prompt padded to the same length would.
"""

from __future__ import annotations

import torch
from diffusers import (
    AuraFlowPipeline,
    AuraFlowTransformer2DModel,
    AutoencoderDC,
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    ChromaPipeline,
    ChromaTransformer2DModel,
    CogView4Pipeline,
    CogView4Transformer2DModel,
    DDPMScheduler,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    HunyuanDiT2DModel,
    HunyuanDiTPipeline,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SanaPipeline,
    SanaTransformer2DModel,
)

from .parts import embeddings, kl_vae, mask, prompt_pair

#: Image tokens the denoiser sees, after VAE downscale and patchify / 2x2 packing.
TOKEN_ROWS = 8
TOKEN_COLS = 4
#: Prompt tokens (HunyuanDiT: 8 CLIP-side + 8 T5-side tokens, 16 in its cross-attention).
PROMPT_TOKENS = 16
#: Trailing tokens masked out of the negative prompt's attention mask, where the pipeline takes a mask.
NEGATIVE_PAD_TOKENS = 4
#: Heads of every attention layer (Lumina2: 8 query heads and 4 key/value heads).
HEADS = 4
HEAD_DIM = 8
INNER_DIM = HEADS * HEAD_DIM
#: Width of the (absent) text encoders' outputs.
TEXT_DIM = 16


def _vae(cls: type = AutoencoderKL, **extra) -> torch.nn.Module:
    """An 8x AutoencoderKL (4 blocks) with 4 channels per block."""
    return kl_vae((4, 4, 4, 4), cls, layers_per_block=1, latent_channels=4, norm_num_groups=1, sample_size=32, **extra)


def _masked_pair(
    generator: torch.Generator, width: int = TEXT_DIM, tokens: int = PROMPT_TOKENS, dtype: torch.dtype = torch.long
) -> dict:
    """Embeddings and masks: the positive prompt fully valid, the negative one with padding at the end."""
    return {
        **prompt_pair(generator, tokens, width),
        "prompt_attention_mask": mask(tokens, tokens, dtype),
        "negative_prompt_attention_mask": mask(tokens - NEGATIVE_PAD_TOKENS, tokens, dtype),
    }


# Each pipeline function runs under the table's seeded RNG; each call function draws embeddings from its generator.


def sana() -> SanaPipeline:
    transformer = SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_cross_attention_heads=HEADS,
        cross_attention_head_dim=HEAD_DIM,
        cross_attention_dim=INNER_DIM,
        caption_channels=TEXT_DIM,
        sample_size=32,
    )
    vae = AutoencoderDC(  # 8x: four blocks
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        encoder_qkv_multiscales=((), (), (), (5,)),
        decoder_qkv_multiscales=((), (), (), (5,)),
        encoder_layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return SanaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)


def sana_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_masked_pair(g),
        negative_prompt=None,  # defaults to "", which check_inputs refuses next to negative_prompt_embeds
        guidance_scale=4.5,
        height=TOKEN_ROWS * 8,  # 8x VAE, patch 1 (Sana needs multiples of 32)
        width=TOKEN_COLS * 8,
        use_resolution_binning=False,
        complex_human_instruction=None,
    )


_HUNYUAN_TEXT_LEN = PROMPT_TOKENS // 2


def hunyuandit() -> HunyuanDiTPipeline:
    transformer = HunyuanDiT2DModel(
        sample_size=16,
        num_layers=4,  # U-ViT long skip: block 3 takes block 0's output
        patch_size=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        in_channels=4,
        cross_attention_dim=INNER_DIM,
        cross_attention_dim_t5=TEXT_DIM,
        pooled_projection_dim=16,
        hidden_size=INNER_DIM,
        activation_fn="gelu-approximate",
        text_len=_HUNYUAN_TEXT_LEN,
        text_len_t5=_HUNYUAN_TEXT_LEN,
    )
    vae = _vae()  # the pipeline computes RoPE for an 8x VAE
    # without clipping the x0 estimate: clipping a random model's estimate at ±1 amplifies float round-off ~100x
    # per step, which would bury an exactness check under it
    scheduler = DDPMScheduler(clip_sample=False)
    return HunyuanDiTPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=None,
        tokenizer_2=None,
    )


def hunyuandit_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    clip_side = _masked_pair(g, INNER_DIM, tokens=_HUNYUAN_TEXT_LEN)
    t5_side = _masked_pair(g, TEXT_DIM, tokens=_HUNYUAN_TEXT_LEN)
    return dict(
        **clip_side,
        **{f"{name}_2": value for name, value in t5_side.items()},
        guidance_scale=5.0,
        height=TOKEN_ROWS * 16,  # 8x VAE, patch 2
        width=TOKEN_COLS * 16,
        use_resolution_binning=False,
    )


def lumina2() -> Lumina2Pipeline:
    transformer = Lumina2Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        hidden_size=2 * INNER_DIM,
        num_layers=4,
        num_refiner_layers=1,
        num_attention_heads=2 * HEADS,
        num_kv_heads=HEADS,
        multiple_of=16,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        scaling_factor=1.0,
        axes_dim_rope=(4, 2, 2),
        axes_lens=(64, 64, 64),
        cap_feat_dim=TEXT_DIM,
    )
    vae = _vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    scheduler = FlowMatchEulerDiscreteScheduler()
    return Lumina2Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None)


def lumina2_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    return dict(
        **_masked_pair(g),
        guidance_scale=4.0,
        height=TOKEN_ROWS * 16,  # the pipeline assumes an 8x VAE; patch 2
        width=TOKEN_COLS * 16,
    )


def auraflow() -> AuraFlowPipeline:
    transformer = AuraFlowTransformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=2,
        num_single_dit_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        caption_projection_dim=INNER_DIM,
        joint_attention_dim=TEXT_DIM,
        out_channels=4,
        pos_embed_max_size=256,
    )
    vae = _vae()
    scheduler = FlowMatchEulerDiscreteScheduler()
    return AuraFlowPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)


def auraflow_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    prompts = _masked_pair(g)
    # AuraFlow's transformer takes no mask: its encode_prompt zeroes the padded rows of the embeddings instead.
    prompts["negative_prompt_embeds"] *= prompts["negative_prompt_attention_mask"].unsqueeze(-1)
    return dict(
        **prompts,
        guidance_scale=3.5,
        height=TOKEN_ROWS * 16,  # 8x VAE, patch 2
        width=TOKEN_COLS * 16,
    )


def cogview4() -> CogView4Pipeline:
    transformer = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=4,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        out_channels=4,
        text_embed_dim=TEXT_DIM,
        time_embed_dim=16,
        condition_dim=4,
        sample_size=16,
    )
    vae = _vae()
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    return CogView4Pipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)


def cogview4_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    # CogView4 takes no text mask: its GLM prompts are left-padded to a multiple of 16 tokens and all attended.
    return dict(
        **prompt_pair(g, PROMPT_TOKENS, TEXT_DIM),
        guidance_scale=5.0,
        height=TOKEN_ROWS * 16,  # 8x VAE, patch 2
        width=TOKEN_COLS * 16,
    )


def qwenimage() -> QwenImagePipeline:
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 latent channels, 2x2 packed by the pipeline
        out_channels=4,
        num_layers=4,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    )
    vae = AutoencoderKLQwenImage(  # 4x
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    scheduler = FlowMatchEulerDiscreteScheduler()
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)


def qwenimage_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    prompts = _masked_pair(g)
    return dict(
        prompt_embeds=prompts["prompt_embeds"],
        prompt_embeds_mask=prompts["prompt_attention_mask"],  # all ones: the pipeline drops it (None)
        negative_prompt_embeds=prompts["negative_prompt_embeds"],
        negative_prompt_embeds_mask=prompts["negative_prompt_attention_mask"],
        true_cfg_scale=4.0,
        height=TOKEN_ROWS * 8,  # 4x VAE, 2x2 packing
        width=TOKEN_COLS * 8,
    )


def chroma() -> ChromaPipeline:
    transformer = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels, 2x2 packed by the pipeline
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(2, 2, 4),
        approximator_hidden_dim=32,
        approximator_layers=1,
        approximator_num_channels=16,
    )
    vae = _vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    scheduler = FlowMatchEulerDiscreteScheduler()
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)


def chroma_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    # Boolean masks: the pipeline appends boolean ones for the image tokens, and the blocks turn the (B, text+image)
    # mask into a (B, 1, L, L) one. (ChromaPipeline's own text path makes float 0/1 masks, which SDPA adds as a bias.)
    return dict(
        **_masked_pair(g, dtype=torch.bool),
        guidance_scale=4.0,
        height=TOKEN_ROWS * 16,  # 8x VAE, 2x2 packing
        width=TOKEN_COLS * 16,
    )


def flux2() -> Flux2Pipeline:
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels, 2x2 patchified by the pipeline
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=256,
        axes_dims_rope=(2, 2, 2, 2),
    )
    vae = _vae(AutoencoderKLFlux2, use_quant_conv=False, use_post_quant_conv=False)  # and the pipeline's 2x2
    scheduler = FlowMatchEulerDiscreteScheduler()
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)


def flux2_call(pipe: DiffusionPipeline, g: torch.Generator) -> dict:
    # Guidance-distilled: guidance_scale is embedded, there is no negative prompt and no CFG.
    return dict(
        prompt_embeds=embeddings(g, PROMPT_TOKENS, TEXT_DIM),
        guidance_scale=4.0,
        height=TOKEN_ROWS * 16,  # 8x VAE, 2x2 patchify
        width=TOKEN_COLS * 16,
    )
