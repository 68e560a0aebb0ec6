"""Multi-rank task functions for the patch-strategy tests (run on every rank of a RankPool).

Each builds a tiny real pipeline with seeded random weights (identical on every rank), computes the
one-device reference in the same process, then the parallel result, and returns small numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from exactness import assert_exact, latents, relative_error

import paradiff
from paradiff.errors import ParadiffError
from paradiff.metrics import psnr
from paradiff.tiny import build_pipeline, prompt_inputs


def generate(pipe, inputs: dict, size: int, steps: int, seed: int = 0, output_type: str = "np", **extra) -> np.ndarray:
    """The call's decoded images (``output_type="np"``) or final latents (``"latent"``), as fp32 numpy."""
    return latents(
        pipe(
            **inputs,
            height=size,
            width=size,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(seed),
            output_type=output_type,
            **extra,
        )
    )


def flux_true_cfg_inputs(pipe) -> dict:
    inputs = prompt_inputs(pipe, "flux")
    negative = prompt_inputs(pipe, "flux", seed=1)
    return {
        **inputs,
        "negative_prompt_embeds": negative["prompt_embeds"],
        "negative_pooled_prompt_embeds": negative["pooled_prompt_embeds"],
        "true_cfg_scale": 2.0,
    }


def parallel_vs_one_device(
    family: str,
    size: int,
    steps: int,
    warmup: int,
    scheduler: str | None = None,
    batch: int = 1,
    true_cfg: bool = False,
    processor: str | None = None,
    output_type: str = "np",
    **options,
) -> dict:
    """One-device output vs ``parallelize(pipe, warmup_steps=warmup, **options)`` on this rank."""
    pipe = build_pipeline(family, scheduler=scheduler)
    if processor == "classic":
        from diffusers.models.attention_processor import AttnProcessor

        pipe.unet.set_attn_processor(AttnProcessor())
    elif processor == "lora":
        add_random_lora(pipe.unet)
    inputs = flux_true_cfg_inputs(pipe) if true_cfg else prompt_inputs(pipe, family, batch_size=batch)
    return against_one_device(pipe, inputs, size, steps, warmup_steps=warmup, output_type=output_type, **options)


def against_one_device(
    pipe, inputs: dict, size: int, steps: int, inspect=None, output_type: str = "np", **options
) -> dict:
    """The one-device output, then ``parallelize(pipe, **options)``'s, then the restored pipeline's, on this rank.

    ``output_type="latent"`` compares the final latents (what :func:`exactness.assert_exact` judges); ``"np"``
    the decoded images (what PSNR floors of displaced runs read). ``output`` (also ``image``) is this rank's
    parallel output, ``error`` its :func:`exactness.relative_error`. ``inspect(pipe)`` runs on the parallelized
    pipeline after its call; the dict it returns joins the result.
    """
    original_class = type(pipe)
    reference = generate(pipe, inputs, size, steps, output_type=output_type)
    pipe = paradiff.parallelize(pipe, **options)
    parallel_class = type(pipe)
    parallel = generate(pipe, inputs, size, steps, output_type=output_type)
    inspected = inspect(pipe) if inspect else {}
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    restored = generate(pipe, inputs, size, steps, output_type=output_type)
    return {
        "rank": dist.get_rank(),
        "error": relative_error(parallel, reference),
        "max_error": float(np.abs(parallel - reference).max()),
        "psnr_db": psnr(parallel, reference),
        "restored_error": float(np.abs(restored - reference).max()),
        "class_changed": parallel_class is not original_class and isinstance(pipe, original_class),
        "class_restored": type(pipe) is original_class and not hasattr(pipe, "_paradiff"),
        "hooks_left": _hooks_left(pipe),
        "output": parallel,
        "image": parallel,  # the same array (pickled once), under the name the image-comparing callers read
        "shape": parallel.shape,
        "stats": stats,
        **inspected,
    }


def displaced_vs_reference(
    family: str, steps: int, reference, scheduler: str | None = None, size: int = 64, **options
) -> dict:
    """This rank's latents under ``parallelize(pipe, **options)`` (a displaced run), the bytes its strategy sent, and
    how far they are from ``reference(pipe, call)`` (a single-process reference of ``displaced_reference``, no
    paradiff code: ``error``) and from one device (``moved``), relative to the latents' largest magnitude."""
    pipe = build_pipeline(family, scheduler=scheduler)
    inputs = prompt_inputs(pipe, family)

    def call() -> dict:
        generator = torch.Generator().manual_seed(0)
        return {**inputs, "height": size, "width": size, "num_inference_steps": steps, "generator": generator}

    one_device = latents(pipe(**call(), output_type="latent"))
    expected = latents(reference(pipe, {**call(), "output_type": "latent"}))
    pipe = paradiff.parallelize(pipe, **options)
    try:
        output = latents(pipe(**call(), output_type="latent"))
        sent = pipe._paradiff.strategy_part.comm.stats.total().bytes_sent
    finally:
        paradiff.unparallelize(pipe)
    return {
        "error": relative_error(output, expected),
        "moved": relative_error(output, one_device),
        "output": output,
        "sent": sent,
    }


def add_random_lora(model) -> None:
    """A LoRA adapter (peft) on attention projections and 3x3 convolutions, with non-zero weights."""
    from peft import LoraConfig

    targets = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian"))
    generator = torch.Generator().manual_seed(7)  # identical adapter weights on every rank
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def _hooks_left(pipe) -> int:
    modules = list(pipe.vae.modules()) + list((getattr(pipe, "unet", None) or pipe.transformer).modules())
    return sum(len(m._diffusers_hook.hooks) for m in modules if hasattr(m, "_diffusers_hook"))


def two_calls_do_not_share_state(
    family: str, size: int, steps: int, warmup: int, first_size: int | None = None, build=build_pipeline, **options
) -> dict:
    """A displaced call after another call (other prompt, and ``first_size`` if given) equals the same call on a
    fresh wrap, latent for latent (a decoded image's clamp could hide a leak). ``build(family)`` makes the pipeline;
    ``options`` go to ``parallelize``."""
    pipe = build(family)
    first, second = prompt_inputs(pipe, family, seed=1), prompt_inputs(pipe, family, seed=2)
    pipe = paradiff.parallelize(pipe, warmup_steps=warmup, **options)
    generate(pipe, first, first_size or size, steps, output_type="latent")
    after_other = generate(pipe, second, size, steps, output_type="latent")
    paradiff.unparallelize(pipe)
    pipe = paradiff.parallelize(pipe, warmup_steps=warmup, **options)
    fresh = generate(pipe, second, size, steps, output_type="latent")
    paradiff.unparallelize(pipe)
    return {"difference": float(np.abs(after_other - fresh).max())}


def resolution_change(family: str, sizes: tuple[int, ...], steps: int) -> dict:
    """Calls at several resolutions on one wrapped pipeline: each re-plans its bands and stays exact (latents)."""
    pipe = build_pipeline(family)
    inputs = prompt_inputs(pipe, family)
    references = [generate(pipe, inputs, size, steps, output_type="latent") for size in sizes]
    pipe = paradiff.parallelize(pipe, warmup_steps=steps)
    outputs = [generate(pipe, inputs, size, steps, output_type="latent") for size in sizes]
    paradiff.unparallelize(pipe)
    return {"runs": [{"error": relative_error(o, r), "output": o} for o, r in zip(outputs, references, strict=True)]}


def refused_before_any_collective(monkeypatch, family: str, world: int, message: str, **options) -> None:
    """``parallelize`` must raise ``message`` from ``WORLD_SIZE`` alone, leaving the pipeline untouched.

    No process group exists, so an error raised after creating one (or after hooking the model) fails here.
    """
    monkeypatch.setenv("WORLD_SIZE", str(world))
    pipe = build_pipeline(family)
    with pytest.raises(ParadiffError, match=message):
        paradiff.parallelize(pipe, **options)
    assert not hasattr(pipe, "_paradiff") and not dist.is_initialized()


def expect_error(family: str, action: str, **options) -> str:
    """Run ``action`` on every rank and return the ParadiffError message each rank raised."""
    pipe = build_pipeline(family)
    try:
        if action == "fused":
            pipe.fuse_qkv_projections()
            paradiff.parallelize(pipe, **options)
        elif action == "processor":
            from diffusers.models.attention_processor import AttnProcessor

            pipe.transformer.set_attn_processor(AttnProcessor())
            paradiff.parallelize(pipe, **options)
        elif action == "twice":
            paradiff.parallelize(pipe, **options)
            paradiff.parallelize(pipe, **options)
        elif action.startswith("height="):
            pipe = paradiff.parallelize(pipe, **options)
            generate(pipe, prompt_inputs(pipe, family), int(action.split("=")[1]), 2)
        else:
            raise AssertionError(f"unknown action {action}")
    except ParadiffError as error:
        return str(error)
    finally:
        paradiff.unparallelize(pipe)
    return ""


def distinct_noise_agrees(family: str, size: int, steps: int) -> dict:
    """Ranks that pass different seeds (or none) still produce one identical image."""
    pipe = paradiff.parallelize(build_pipeline(family), warmup_steps=steps)
    inputs = prompt_inputs(pipe, family)
    seeded = generate(pipe, inputs, size, steps, seed=100 + dist.get_rank())
    unseeded = pipe(**inputs, height=size, width=size, num_inference_steps=steps, output_type="np").images
    paradiff.unparallelize(pipe)
    return {"seeded": seeded, "unseeded": unseeded}


def user_callback_runs(family: str, size: int, steps: int) -> list[int]:
    """A user's callback_on_step_end still runs once per step with the stock step indices."""
    seen = []

    def callback(pipe, step, timestep, kwargs):
        seen.append(step)
        return kwargs

    pipe = paradiff.parallelize(build_pipeline(family), warmup_steps=1)
    generate(pipe, prompt_inputs(pipe, family), size, steps, callback_on_step_end=callback)
    paradiff.unparallelize(pipe)
    return seen


def banded_decode(rows: int) -> dict:
    """``vae.decode`` on a parallelized pipeline: banded when rows divide, whole on every rank otherwise."""
    pipe = build_pipeline("sd")
    latent = torch.randn(1, 4, rows, 8, generator=torch.Generator().manual_seed(3))
    reference = pipe.vae.decode(latent).sample.detach().numpy()
    pipe = paradiff.parallelize(pipe)
    decoded = pipe.vae.decode(latent).sample.detach().numpy()
    sent = pipe._paradiff.decoder_part.comm.stats.total().bytes_sent
    paradiff.unparallelize(pipe)
    return {
        "error": relative_error(decoded, reference),
        "max_error": float(np.abs(decoded - reference).max()),
        "output": decoded,
        "bytes_sent": sent,
    }


def half_precision(family: str, dtype_name: str) -> dict:
    """The model's dtype flows through the exchanges: the one-device latents (fp32: exactly), half the bytes of fp32."""
    dtype = getattr(torch, dtype_name)
    pipe = build_pipeline(family).to(dtype)
    inputs = {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in prompt_inputs(pipe, family).items()
    }
    reference = generate(pipe, inputs, 64, 3, output_type="latent")
    pipe = paradiff.parallelize(pipe, warmup_steps=3)
    parallel = generate(pipe, inputs, 64, 3, output_type="latent")
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    return {"error": relative_error(parallel, reference), "output": parallel, "bytes_per_step": stats["bytes_per_step"]}


def binned_height(height: int) -> dict:
    """PixArt bins the requested size itself: a height it bins to an aligned one works."""
    pipe = paradiff.parallelize(build_pipeline("pixart", size="bench"), warmup_steps=1)
    inputs = {**prompt_inputs(pipe, "pixart"), "use_resolution_binning": True}
    images = generate(pipe, inputs, height, 1)
    paradiff.unparallelize(pipe)
    return {"shape": images.shape}


def check_exact_and_restored(results: list[dict], steps: int) -> None:
    """What every exact strategy promises, on every rank's result of :func:`parallel_vs_one_device` (latents).

    Exact (:func:`exactness.assert_exact`: the one-device latents within round-off, the same on every rank),
    nothing displaced, ``steps`` counted, traffic on every step, and ``unparallelize`` restoring class, hooks
    and output.
    """
    assert_exact(results)
    for result in results:
        stats = result["stats"]
        assert result["restored_error"] == 0.0
        assert result["class_changed"] and result["class_restored"]
        assert result["hooks_left"] == 0
        assert stats["steps"] == steps
        assert stats["stale_layer_exchanges"] == 0
        assert all(row["bytes_sent"] > 0 for row in stats["per_step"])
