"""What users stack on a pipeline, as the composition tests apply it: each feature on a tiny pipeline of one family.

A :class:`Feature` builds its pipeline (``build``), changes it before ``parallelize`` (``before``) and after it
(``after``; on one rank only with ``one_rank``), and gives the call's arguments (``inputs``). :func:`compose`
runs it on every rank of a pool: the one-device output of the same feature (``before`` and ``after`` applied,
no paradiff), then the parallel one (``after`` applied between a first call and the compared call), and
returns this rank's error against one device, or the refusal it raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from exactness import TOLERANCE, latents, relative_error

import paradiff
from paradiff.errors import ParadiffError
from paradiff.models import find_denoiser
from paradiff.tiny import build_pipeline, prompt_inputs

SIZE, STEPS, TEXT_TOKENS = 64, 4, 8
#: bf16 round-off on these 4-step latents: bf16 itself moves them 2–3e-2 (of their largest magnitude) from fp32,
#: and a band or a head split rounds a few operations differently.
BF16_TOLERANCE = 5e-2
#: LoRA targets: attention projections everywhere, and the U-Net's 3×3 convolutions (which ``patch`` bands).
LORA_TARGETS = {
    "sd": ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"],
    "flux": ["to_q", "to_k", "to_v", "to_out.0"],
}


def nothing(pipe) -> None:
    """No change."""


@dataclass(frozen=True)
class Feature:
    family: str
    before: Callable = nothing
    after: Callable = nothing
    #: ``after`` runs on rank 0 only (a change the ranks do not share).
    one_rank: bool = False
    #: Largest error against one device relative to its largest magnitude: fp32 round-off, or the dtype's.
    tolerance: float = TOLERANCE
    #: Extra arguments of every call.
    call: dict = field(default_factory=dict)
    #: Prompts per call.
    prompts: int = 1
    #: The optional package it needs (the test is skipped without it).
    needs: str | None = None
    build: Callable | None = None


def lora_state_dict(pipe, family: str, seed: int = 7) -> dict:
    """A LoRA of random (seeded) weights in the format ``pipe.load_lora_weights`` reads, from no file."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    denoiser = find_denoiser(pipe)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        copy = type(denoiser).from_config(denoiser.config)
        config = LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS[family], init_lora_weights="gaussian")
        copy.add_adapter(config)
        with torch.no_grad():
            for name, param in copy.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape) * 0.05)
    prefix = "unet" if hasattr(pipe, "unet") else "transformer"
    return {f"{prefix}.{key}": value for key, value in get_peft_model_state_dict(copy).items()}


def load_lora(family: str, name: str = "style"):
    def load(pipe) -> None:
        pipe.load_lora_weights(lora_state_dict(pipe, family), adapter_name=name)

    return load


def hotswap_lora(family: str):
    """Another LoRA's weights swapped into the loaded adapter "style" in place (peft's hotswap)."""

    def swap(pipe) -> None:
        pipe.load_lora_weights(lora_state_dict(pipe, family, seed=8), adapter_name="style", hotswap=True)

    return swap


def then(*changes: Callable) -> Callable:
    def change(pipe) -> None:
        for one in changes:
            one(pipe)

    return change


def scale_adapter(pipe) -> None:
    pipe.set_adapters(["style"], [0.5])


def fuse_lora(pipe) -> None:
    pipe.fuse_lora()


def unload_lora(pipe) -> None:
    pipe.unload_lora_weights()


def fuse_qkv(pipe) -> None:
    getattr(pipe, "fuse_qkv_projections", find_denoiser(pipe).fuse_qkv_projections)()


def euler_scheduler(pipe) -> None:
    from diffusers import EulerDiscreteScheduler

    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)


def scale_weights(pipe) -> None:
    with torch.no_grad():
        next(find_denoiser(pipe).parameters()).mul_(1.05)


def torchao_int8(pipe) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(find_denoiser(pipe), Int8WeightOnlyConfig())


def quanto_int8(pipe) -> None:
    from optimum.quanto import freeze, qint8, quantize

    quantize(find_denoiser(pipe), weights=qint8)
    freeze(find_denoiser(pipe))


def fp8_storage(pipe) -> None:
    find_denoiser(pipe).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def bf16(pipe) -> None:
    pipe.to(torch.bfloat16)


def _random_weights(module: torch.nn.Module, seed: int) -> None:
    """Seeded random weights everywhere: a ControlNet's zero-initialised output layers would hide a misplaced
    residual."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for param in module.parameters():
            param.copy_(torch.randn(param.shape) * 0.05)


def flux_controlnet():
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    base = build_pipeline("flux")
    config = {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2}
    controlnet = FluxControlNetModel.from_transformer(base.transformer, load_weights_from_transformer=False, **config)
    _random_weights(controlnet, 1)
    pipe = FluxControlNetPipeline(controlnet=controlnet, text_encoder=None, tokenizer=None, **_parts(base))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sd3_controlnet():
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    base = build_pipeline("sd3")
    controlnet = SD3ControlNetModel.from_transformer(
        base.transformer, num_layers=1, num_extra_conditioning_channels=0, load_weights_from_transformer=False
    )
    _random_weights(controlnet, 1)
    encoders = {"text_encoder": None, "tokenizer": None, "text_encoder_3": None, "tokenizer_3": None}
    pipe = StableDiffusion3ControlNetPipeline(controlnet=controlnet, **encoders, **_parts(base))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _parts(base) -> dict:
    """The tiny pipeline's transformer, VAE and scheduler, and no second text encoder."""
    parts = {"transformer": base.transformer, "vae": base.vae, "scheduler": base.scheduler}
    return {**parts, "text_encoder_2": None, "tokenizer_2": None}


CONTROL_IMAGE = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))

FEATURES: dict[str, Feature] = {
    # Quantized and low-precision weights, applied before parallelize.
    "torchao int8 weight-only · SD": Feature("sd", before=torchao_int8, needs="torchao"),
    "torchao int8 weight-only · Flux": Feature("flux", before=torchao_int8, needs="torchao"),
    "quanto int8 weights · Flux": Feature("flux", before=quanto_int8, needs="optimum.quanto"),
    "fp8 layerwise casting · SD": Feature("sd", before=fp8_storage),
    "fp8 layerwise casting · Flux": Feature("flux", before=fp8_storage),
    "bf16 · SD": Feature("sd", before=bf16, tolerance=BF16_TOLERANCE),
    "bf16 · Flux": Feature("flux", before=bf16, tolerance=BF16_TOLERANCE),
    # The model changed after parallelize, on every rank.
    "LoRA loaded after parallelize · SD": Feature("sd", after=load_lora("sd")),
    "LoRA loaded after parallelize · Flux": Feature("flux", after=load_lora("flux")),
    "LoRA unloaded after parallelize · SD": Feature("sd", before=load_lora("sd"), after=unload_lora),
    "LoRA hot-swapped after parallelize · SD": Feature("sd", before=load_lora("sd"), after=hotswap_lora("sd")),
    "LoRA hot-swapped after parallelize · Flux": Feature("flux", before=load_lora("flux"), after=hotswap_lora("flux")),
    "LoRA scale set after parallelize · SD": Feature("sd", before=load_lora("sd"), after=scale_adapter),
    "LoRA fused after parallelize · SD": Feature("sd", before=load_lora("sd"), after=fuse_lora),
    "QKV fused after parallelize · SD": Feature("sd", after=fuse_qkv),
    "QKV fused after parallelize · Flux": Feature("flux", after=fuse_qkv),
    "torchao int8 after parallelize · Flux": Feature("flux", after=torchao_int8, needs="torchao"),
    "another scheduler after parallelize · SD": Feature("sd", after=euler_scheduler),
    # ControlNet on DiTs, and batches.
    "ControlNet · Flux": Feature("flux", build=flux_controlnet, call={"control_image": CONTROL_IMAGE}),
    "ControlNet · SD3": Feature("sd3", build=sd3_controlnet, call={"control_image": CONTROL_IMAGE}),
    "2 images per prompt · Flux": Feature("flux", call={"num_images_per_prompt": 2}),
    "2 prompts · Flux": Feature("flux", prompts=2),
    "2 prompts · SD3": Feature("sd3", prompts=2),
    # ... on one rank only.
    "weights ×1.05 on one rank · SD": Feature("sd", after=scale_weights, one_rank=True),
    "another scheduler on one rank · SD": Feature("sd", after=euler_scheduler, one_rank=True),
}


def _inputs(pipe, feature: Feature, strategy: str) -> dict:
    inputs = prompt_inputs(pipe, feature.family, batch_size=feature.prompts, seq_len=TEXT_TOKENS)
    if feature.family == "flux" and strategy == "cfg":  # the distilled Flux runs no CFG: true CFG gives it halves
        negative = prompt_inputs(pipe, "flux", batch_size=feature.prompts, seed=1, seq_len=TEXT_TOKENS)
        inputs["negative_prompt_embeds"] = negative["prompt_embeds"]
        inputs["negative_pooled_prompt_embeds"] = negative["pooled_prompt_embeds"]
        inputs["true_cfg_scale"] = 2.0
    return inputs


def _generate(pipe, inputs: dict, steps: int, extra: dict, global_seed: int = 0):
    """The call's latents, from generator seed 0; ``global_seed`` seeds the draws a pipeline makes without the
    generator (SD3 ControlNet's), which paradiff takes from rank 0."""
    torch.manual_seed(global_seed)
    generator = torch.Generator().manual_seed(0)
    call = {"height": SIZE, "width": SIZE, "num_inference_steps": steps, "output_type": "latent", **extra}
    return latents(pipe(**inputs, generator=generator, **call))


def compose(name: str, strategy: str) -> dict:
    """On every rank: this rank's output and its error against one device, or the ParadiffError it raised."""
    feature = FEATURES[name]
    build = feature.build or (lambda: build_pipeline(feature.family))
    pipe = build()
    feature.before(pipe)
    feature.after(pipe)
    inputs = _inputs(pipe, feature, strategy)
    reference = _generate(pipe, inputs, STEPS, feature.call)
    pipe = build()
    feature.before(pipe)
    options = {"strategy": strategy, "warmup_steps": STEPS}
    try:
        pipe = paradiff.parallelize(pipe, **options)
        _generate(pipe, inputs, 2, feature.call)  # a call before the change: the change comes after one
        if not feature.one_rank or dist.get_rank() == 0:
            feature.after(pipe)
        output = _generate(pipe, inputs, STEPS, feature.call, global_seed=1000 * dist.get_rank())
    except ParadiffError as error:
        return {"refusal": str(error)}
    finally:
        paradiff.unparallelize(pipe)
    return {"refusal": None, "error": relative_error(output, reference), "output": output}
