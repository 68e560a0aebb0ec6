"""The five classic families, SD, SDXL, PixArt-Sigma, SD3 and Flux, at two sizes, with random weights.

``pipeline(family, size, scheduler)`` builds a genuine diffusers pipeline (``StableDiffusionPipeline``,
``StableDiffusionXLPipeline``, ``PixArtSigmaPipeline``, ``StableDiffusion3Pipeline`` or ``FluxPipeline``)
whose denoiser and VAE are instantiated from the hand-written configs below; the table
(:mod:`paradiff.tiny.table`) runs it under a seeded RNG.

Text encoders and tokenizers
----------------------------
All five pipelines accept ``None`` for every tokenizer and text encoder, and their ``__call__`` never
touches them as long as the prompt embeddings are supplied directly (for the CFG pipelines this
includes the *negative* embeddings, otherwise they would try to encode the empty negative prompt).
``prompt_inputs(pipe, family)`` returns exactly the keyword arguments each pipeline needs instead of a
text prompt:

* ``sd``     -- ``prompt_embeds``, ``negative_prompt_embeds``, ``guidance_scale=7.5``.
* ``sdxl``   -- the above plus ``pooled_prompt_embeds`` / ``negative_pooled_prompt_embeds``
  (``guidance_scale=5.0``).  With ``text_encoder_2=None`` the pipeline takes the time-embedding
  projection width from ``pooled_prompt_embeds.shape[-1]``, so the pooled width must equal
  ``projection_class_embeddings_input_dim - 6 * addition_time_embed_dim`` of the UNet.
* ``pixart`` -- ``prompt_embeds``, ``prompt_attention_mask``, ``negative_prompt_embeds``,
  ``negative_prompt_attention_mask`` (the pipeline refuses embeddings without masks),
  ``negative_prompt=None`` (its default ``""`` clashes with ``negative_prompt_embeds``),
  ``guidance_scale=4.5`` and ``use_resolution_binning=False``: binning only knows transformer
  ``sample_size`` 32/64/128/256 and would otherwise silently resize the requested image to an
  aspect-ratio bucket (and the tiny transformer has ``sample_size=8``).
* ``sd3``    -- ``prompt_embeds``, ``negative_prompt_embeds``, ``pooled_prompt_embeds``,
  ``negative_pooled_prompt_embeds``, ``guidance_scale=7.0``.
* ``flux``   -- ``prompt_embeds``, ``pooled_prompt_embeds`` and the *distilled* ``guidance_scale=3.5``
  (the transformer has ``guidance_embeds=True``); no negative embeddings, so ``true_cfg_scale``
  stays off and each step runs a single transformer pass.

``prompt_inputs`` does not include a ``generator``; pass one (or ``latents``) yourself when you need
reproducible initial noise.

Sizes
-----
``"tiny"``  -- for unit tests; a full 2-step run at 64x64 (or 128x128) takes a fraction of a second.
``"bench"`` -- roughly 30-40M-parameter denoisers meant for 512x512 images (64x64 latents); the
exact parameter counts are noted next to each config below.

``FluxPipeline`` hard-codes ``default_sample_size = 128`` (1024 px); ``pipeline`` overrides it so
that omitting ``height``/``width`` gives 64 px (tiny) or 512 px (bench) like the other families.

VAEs use four levels (``vae_scale_factor == 8``).  The SD3 and Flux VAEs have 16 latent channels,
no quant convs and the real scaling/shift factors; SD uses 0.18215 and SDXL/PixArt 0.13025.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
)

from .parts import kl_vae

FAMILIES = ("sd", "sdxl", "pixart", "sd3", "flux")
SIZES = ("tiny", "bench")
SCHEDULERS = ("ddim", "euler", "dpm", "unipc", "flow")

_FLOW_FAMILIES = ("sd3", "flux")
_DEFAULT_SCHEDULER = {"sd": "ddim", "sdxl": "ddim", "pixart": "dpm", "sd3": "flow", "flux": "flow"}
_GUIDANCE = {"sd": 7.5, "sdxl": 5.0, "pixart": 4.5, "sd3": 7.0, "flux": 3.5}

# Number of text tokens prompt_inputs generates.  "bench" mirrors the real models
# (CLIP 77; T5 300 for PixArt-Sigma; 77 CLIP + 256 T5 for SD3; 512 T5 for Flux-dev).
_TEXT_LEN = {
    "tiny": {"sd": 8, "sdxl": 8, "pixart": 8, "sd3": 8, "flux": 8},
    "bench": {"sd": 77, "sdxl": 77, "pixart": 300, "sd3": 333, "flux": 512},
}
_TEXT_LEN_ATTR = "_paradiff_text_len"

# ----------------------------------------------------------------------------------------------
# Denoiser configs
# ----------------------------------------------------------------------------------------------

_SD_BLOCKS = {
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
}
_SDXL_BLOCKS = {
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
}

#: Structure shared by the "tiny" and "bench" configs of a family; the size configs add the dimensions.
_FAMILY_STRUCTURE: dict[str, dict[str, Any]] = {
    "sd": {},
    "sdxl": dict(use_linear_projection=True, addition_embed_type="text_time", **_SDXL_BLOCKS),
    "pixart": dict(
        patch_size=2,
        in_channels=4,
        out_channels=8,  # learned sigma, as PixArt-Sigma
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    ),
    "sd3": dict(patch_size=2, in_channels=16, out_channels=16),
    "flux": dict(patch_size=1, in_channels=64, guidance_embeds=True),  # 16 latent channels packed 2x2
}

_DENOISER_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        # SD-1.x layout shrunk: conv proj_in/proj_out, 2 cross-attn levels + 1 plain level,
        # UNetMidBlock2DCrossAttn, GroupNorm with 4 (16 ch) / 8 (32 ch) channels per group.
        "sd": dict(
            sample_size=8,
            block_out_channels=(16, 32, 32),
            layers_per_block=1,
            norm_num_groups=4,
            cross_attention_dim=32,
            attention_head_dim=(2, 4, 4),  # number of heads per level (diffusers naming): head dim 8
            **_SD_BLOCKS,
        ),
        # SDXL layout shrunk: plain first level, linear proj, multi-layer transformers at the
        # deepest level and in the mid block, "text_time" added conditioning.
        "sdxl": dict(
            sample_size=8,
            block_out_channels=(16, 32, 32),
            layers_per_block=1,
            norm_num_groups=4,
            cross_attention_dim=32,
            attention_head_dim=(2, 4, 4),
            transformer_layers_per_block=(1, 1, 2),
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=16 + 6 * 8,  # pooled width 16
        ),
        "pixart": dict(
            sample_size=8,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=16,
            cross_attention_dim=32,
            caption_channels=32,
        ),
        "sd3": dict(
            sample_size=8,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=16,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=16,
            pos_embed_max_size=32,  # enough for up to 512x512 pixels
        ),
        "flux": dict(
            num_layers=1,
            num_single_layers=1,
            num_attention_heads=2,
            attention_head_dim=16,
            axes_dims_rope=(4, 6, 6),
            joint_attention_dim=32,
            pooled_projection_dim=16,
        ),
    },
    "bench": {
        # 4-level SD-1.x layout, 2 resnets per level, CLIP-L width text: 35,029,828 parameters.
        "sd": dict(
            sample_size=64,
            block_out_channels=(128, 192, 192, 192),
            layers_per_block=2,
            norm_num_groups=32,
            cross_attention_dim=768,
            attention_head_dim=(4, 6, 6, 6),  # heads per level: head dim 32
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        ),
        # 3-level SDXL layout: 38,988,932 parameters.
        "sdxl": dict(
            sample_size=64,
            block_out_channels=(64, 128, 256),
            layers_per_block=2,
            norm_num_groups=32,
            cross_attention_dim=1024,
            attention_head_dim=(2, 4, 8),  # head dim 32
            transformer_layers_per_block=(1, 1, 2),
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=512 + 6 * 256,  # pooled width 512
        ),
        # 12 blocks, hidden 384 (6 heads x 64), T5-XXL caption width: 31,273,376 parameters.
        "pixart": dict(
            sample_size=64,
            num_layers=12,
            num_attention_heads=6,
            attention_head_dim=64,
            cross_attention_dim=384,
            caption_channels=4096,
        ),
        # 6 joint blocks, hidden 384: 33,098,560 parameters.
        "sd3": dict(
            sample_size=64,
            num_layers=6,
            num_attention_heads=6,
            attention_head_dim=64,
            joint_attention_dim=4096,
            caption_projection_dim=384,
            pooled_projection_dim=2048,
            pos_embed_max_size=96,
        ),
        # 3 double-stream + 6 single-stream blocks, hidden 384: 32,112,448 parameters.
        "flux": dict(
            num_layers=3,
            num_single_layers=6,
            num_attention_heads=6,
            attention_head_dim=64,
            axes_dims_rope=(16, 24, 24),
            joint_attention_dim=4096,
            pooled_projection_dim=768,
        ),
    },
}

_DENOISER_CLASSES = {
    "sd": UNet2DConditionModel,
    "sdxl": UNet2DConditionModel,
    "pixart": PixArtTransformer2DModel,
    "sd3": SD3Transformer2DModel,
    "flux": FluxTransformer2DModel,
}

# ----------------------------------------------------------------------------------------------
# VAE configs
# ----------------------------------------------------------------------------------------------

_VAE_SIZES = {
    "tiny": dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4, sample_size=64),
    "bench": dict(block_out_channels=(32, 64, 128, 128), layers_per_block=1, norm_num_groups=16, sample_size=512),
}
_VAE_LATENTS = {
    "sd": dict(latent_channels=4, scaling_factor=0.18215),
    "sdxl": dict(latent_channels=4, scaling_factor=0.13025),
    "pixart": dict(latent_channels=4, scaling_factor=0.13025),
    "sd3": dict(
        latent_channels=16,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ),
    "flux": dict(
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ),
}

# ----------------------------------------------------------------------------------------------
# Scheduler configs
# ----------------------------------------------------------------------------------------------

_SCHEDULER_CLASSES = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "dpm": DPMSolverMultistepScheduler,
    "unipc": UniPCMultistepScheduler,
    "flow": FlowMatchEulerDiscreteScheduler,
}
_BETA_SCHEDULES = {
    # Stable Diffusion 1.x / XL training schedule.
    "sd": dict(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="leading",
    ),
    # PixArt-Sigma training schedule.
    "pixart": dict(
        num_train_timesteps=1000,
        beta_start=0.0001,
        beta_end=0.02,
        beta_schedule="linear",
        prediction_type="epsilon",
        algorithm_type="dpmsolver++",
        solver_order=2,
        lower_order_final=True,
        timestep_spacing="linspace",
    ),
}
_BETA_SCHEDULES["sdxl"] = _BETA_SCHEDULES["sd"]
_FLOW_SCHEDULES = {
    "sd3": dict(num_train_timesteps=1000, shift=3.0),
    "flux": dict(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    ),
}


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}; valid families are {', '.join(FAMILIES)}.")


def check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}; valid sizes are {', '.join(SIZES)}.")


def table_name(family: str, size: str) -> str:
    """The table's name of ``family`` at ``size``: the family's own name at "tiny", ``<family>-bench`` at "bench"."""
    return family if size == "tiny" else f"{family}-{size}"


def _make_scheduler(family: str, name: str | None):
    name = _DEFAULT_SCHEDULER[family] if name is None else name
    if name not in _SCHEDULER_CLASSES:
        raise ValueError(f"Unknown scheduler {name!r}; valid schedulers are {', '.join(SCHEDULERS)}.")
    if family in _FLOW_FAMILIES:
        if name != "flow":
            raise ValueError(
                f"Scheduler {name!r} is not valid for the flow-matching family {family!r}; "
                "the only valid choice is 'flow' (or None for the default)."
            )
        return FlowMatchEulerDiscreteScheduler(**_FLOW_SCHEDULES[family])
    if name == "flow":
        valid = ", ".join(n for n in SCHEDULERS if n != "flow")
        raise ValueError(
            f"Scheduler 'flow' is only valid for the flow-matching families {', '.join(_FLOW_FAMILIES)}; "
            f"for {family!r} choose one of {valid} (or None for the default)."
        )
    cls = _SCHEDULER_CLASSES[name]
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in _BETA_SCHEDULES[family].items() if k in accepted})


def _float32(module: torch.nn.Module) -> torch.nn.Module:
    # Only cast when needed: ModelMixin.to(dtype=...) warns about _keep_in_fp32_modules otherwise.
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module = module.to(dtype=torch.float32)
    return module


def pipeline(family: str, size: str, scheduler: str | None = None) -> DiffusionPipeline:
    """A real diffusers pipeline of ``family`` at ``size``, random weights drawn from the global RNG.

    On CPU in float32, with no text encoders or tokenizers: call it with ``pipe(**prompt_inputs(pipe, family), ...)``.
    """
    sched = _make_scheduler(family, scheduler)
    denoiser = _float32(_DENOISER_CLASSES[family](**_FAMILY_STRUCTURE[family], **_DENOISER_CONFIGS[size][family]))
    vae = _float32(kl_vae(**_VAE_SIZES[size], **_VAE_LATENTS[family]))

    if family == "sd":
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            unet=denoiser,
            scheduler=sched,
            safety_checker=None,
            feature_extractor=None,
            image_encoder=None,
            requires_safety_checker=False,
        )
    elif family == "sdxl":
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=None,
            text_encoder_2=None,
            tokenizer=None,
            tokenizer_2=None,
            unet=denoiser,
            scheduler=sched,
            add_watermarker=False,
        )
    elif family == "pixart":
        pipe = PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=denoiser, scheduler=sched)
    elif family == "sd3":
        pipe = StableDiffusion3Pipeline(
            transformer=denoiser,
            scheduler=sched,
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            text_encoder_3=None,
            tokenizer_3=None,
        )
    else:
        pipe = FluxPipeline(
            scheduler=sched,
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            transformer=denoiser,
        )
    if family == "flux":
        # FluxPipeline hard-codes default_sample_size=128 (1024 px); match the model's intended size.
        pipe.default_sample_size = 8 if size == "tiny" else 64
    setattr(pipe, _TEXT_LEN_ATTR, _TEXT_LEN[size][family])
    return pipe


def call(family: str, pipe: DiffusionPipeline, generator: torch.Generator) -> dict[str, Any]:
    """The table's call arguments: :func:`prompt_inputs`, drawn from ``generator``."""
    return _inputs(pipe, family, generator, batch_size=1, seq_len=None)


def _denoiser(pipe: DiffusionPipeline) -> torch.nn.Module:
    module = getattr(pipe, "unet", None)
    return module if module is not None else pipe.transformer


def prompt_inputs(
    pipe: DiffusionPipeline, family: str, batch_size: int = 1, seed: int = 0, seq_len: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``pipe(...)`` that replace a text prompt.

    Returns seeded random embeddings of the shapes the pipeline's denoiser expects (on the denoiser's
    device and dtype, but drawn on CPU so they are identical everywhere) plus the family's usual
    ``guidance_scale`` (CFG on for sd/sdxl/pixart/sd3, distilled guidance for flux) and, for pixart,
    ``use_resolution_binning=False``.  ``seq_len`` overrides the number of text tokens.
    """
    check_family(family)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    return _inputs(pipe, family, torch.Generator("cpu").manual_seed(seed), batch_size, seq_len)


def _inputs(
    pipe: DiffusionPipeline, family: str, gen: torch.Generator, batch_size: int, seq_len: int | None
) -> dict[str, Any]:
    den = _denoiser(pipe)
    cfg = den.config
    device, dtype = den.device, den.dtype
    if seq_len is None:
        seq_len = getattr(pipe, _TEXT_LEN_ATTR, _TEXT_LEN["bench"][family])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    out: dict[str, Any] = {"guidance_scale": _GUIDANCE[family]}
    if family == "sd":
        out["prompt_embeds"] = randn(batch_size, seq_len, cfg.cross_attention_dim)
        out["negative_prompt_embeds"] = randn(batch_size, seq_len, cfg.cross_attention_dim)
    elif family == "sdxl":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        out["prompt_embeds"] = randn(batch_size, seq_len, cfg.cross_attention_dim)
        out["negative_prompt_embeds"] = randn(batch_size, seq_len, cfg.cross_attention_dim)
        out["pooled_prompt_embeds"] = randn(batch_size, pooled)
        out["negative_pooled_prompt_embeds"] = randn(batch_size, pooled)
    elif family == "pixart":
        # Like T5 output: a prompt of random length padded to seq_len; the empty negative prompt
        # is a single EOS token.
        lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (batch_size,), generator=gen)
        positions = torch.arange(seq_len)
        out["prompt_embeds"] = randn(batch_size, seq_len, cfg.caption_channels)
        out["prompt_attention_mask"] = (positions[None, :] < lengths[:, None]).long().to(device)
        out["negative_prompt_embeds"] = randn(batch_size, seq_len, cfg.caption_channels)
        out["negative_prompt_attention_mask"] = (positions[None, :] < 1).long().repeat(batch_size, 1).to(device)
        out["negative_prompt"] = None  # the default "" clashes with negative_prompt_embeds
        out["use_resolution_binning"] = False
    elif family == "sd3":
        out["prompt_embeds"] = randn(batch_size, seq_len, cfg.joint_attention_dim)
        out["negative_prompt_embeds"] = randn(batch_size, seq_len, cfg.joint_attention_dim)
        out["pooled_prompt_embeds"] = randn(batch_size, cfg.pooled_projection_dim)
        out["negative_pooled_prompt_embeds"] = randn(batch_size, cfg.pooled_projection_dim)
    else:
        out["prompt_embeds"] = randn(batch_size, seq_len, cfg.joint_attention_dim)
        out["pooled_prompt_embeds"] = randn(batch_size, cfg.pooled_projection_dim)
    return out
