"""Exact sequence parallelism (`ulysses`, `ring`) through diffusers' own context parallelism, on gloo CPU ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from diffusers.models.attention_processor import AttnProcessor
from exactness import assert_exact, relative_error
from patch_cases import (
    against_one_device,
    check_exact_and_restored,
    generate,
    parallel_vs_one_device,
    refused_before_any_collective,
)

import paradiff
from paradiff import ParadiffError
from paradiff.layers.sdpa_dispatch import DispatchedSDPAHook
from paradiff.layers.sequence_hooks import sequence_split_error
from paradiff.models import Grid, family_of
from paradiff.strategies import strategy_class, strategy_names
from paradiff.tiny import build_pipeline, prompt_inputs


def _check_exact(results, steps: int, cfg_gathers: int = 0):
    check_exact_and_restored(results, steps)
    for result in results:
        assert result["stats"]["sync_layer_exchanges"] > 0
        assert result["stats"]["cfg_gathers"] == cfg_gathers


@pytest.mark.parametrize("family", ["pixart", "flux", "sd3"])
def test_ulysses_is_exact_at_2_ranks(pool2, family):
    steps = 2
    results = pool2.run(parallel_vs_one_device, family, 64, steps, warmup=0, strategy="ulysses", output_type="latent")
    _check_exact(results, steps)


def with_heads(pipe, family: str, heads: int):
    """``pipe`` with its transformer rebuilt (seeded) with ``heads`` attention heads of the same width each."""
    config = dict(pipe.transformer.config, num_attention_heads=heads)
    width = heads * config["attention_head_dim"]
    config.update({"pixart": {"cross_attention_dim": width}, "sd3": {"caption_projection_dim": width}}.get(family, {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.register_modules(transformer=type(pipe.transformer).from_config(config).eval())
    return pipe


def uneven_heads_vs_one_device(family: str, heads: int) -> dict:
    pipe = with_heads(build_pipeline(family), family, heads)
    return against_one_device(pipe, prompt_inputs(pipe, family), 64, 2, output_type="latent", strategy="ulysses")


@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_ulysses_runs_a_head_count_the_ranks_do_not_divide(pool2, family):
    """3 heads on 2 ranks: PixArt's attention call is paradiff's, which pads the heads itself; Flux's stock processor
    runs in diffusers' uneven mode. Exact, and the bytes count the zero head each rank exchanges."""
    results = pool2.run(uneven_heads_vs_one_device, family, 3)
    _check_exact(results, 2)
    if family == "pixart":  # as test_ulysses_counts_the_bytes_it_moves, with 4 of 3 heads' width in each exchange
        local = 2 * 8 * 48 * 4 * 4 // 3
        assert results[0]["stats"]["per_step"][0]["bytes_sent"] == 2 * 4 * local // 2 + 2 * 8 * 8 * 8 * 4 // 2


def test_ulysses_counts_the_bytes_it_moves(pool2):
    """PixArt at 64 px with CFG: 2 × 16 tokens of width 32 in fp32, 2 self-attention layers, 2 ranks."""
    stats = pool2.run(parallel_vs_one_device, "pixart", 64, 1, 0, strategy="ulysses", output_type="latent")[0]["stats"]
    local = 2 * 8 * 32 * 4  # batch × local tokens × width × fp32 bytes: one of Q, K, V, output
    attention = 2 * 4 * local // 2  # per layer, each rank keeps 1/2 of the 4 tensors it all-to-alls
    output = 2 * 8 * 8 * 8 * 4 // 2  # the (2, 8, 8, 8) noise prediction, each rank sends its half
    assert stats["per_step"][0]["bytes_sent"] == attention + output


def test_ulysses_within_cfg_halves_is_exact_at_4_ranks(pool4):
    steps = 2
    results = pool4.run(
        parallel_vs_one_device, "pixart", 64, steps, 0, strategy="ulysses", cfg_parallel=True, output_type="latent"
    )
    _check_exact(results, steps, cfg_gathers=steps)


def reparallelize(family: str) -> dict:
    """unparallelize restores the model exactly (processors, config, hooks), so it can be parallelized again."""
    pipe = build_pipeline(family)
    model = pipe.transformer
    inputs = prompt_inputs(pipe, family)
    reference = generate(pipe, inputs, 64, 2, output_type="latent")
    processors = dict(model.attn_processors)
    runs = []
    for _ in range(2):
        pipe = paradiff.parallelize(pipe, strategy="ulysses")
        replaced = sum(model.attn_processors[name] is not p for name, p in processors.items())
        output = generate(pipe, inputs, 64, 2, output_type="latent")
        runs.append({"error": relative_error(output, reference), "output": output})
        paradiff.unparallelize(pipe)
    return {
        "runs": runs,
        "replaced": replaced,
        "processors_restored": all(model.attn_processors[name] is p for name, p in processors.items()),
        "configs_left": sum(getattr(p, "_parallel_config", None) is not None for p in model.attn_processors.values()),
        "model_config": model._parallel_config,
        "instance_attributes": sorted({"_parallel_config", "_resolve_parallel_config"} & set(vars(model))),
    }


@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_unparallelize_restores_the_model(pool2, family):
    """No processor is replaced (PixArt's stock ones have their attention call dispatched by a hook); Flux's stock
    processors lose the config."""
    results = pool2.run(reparallelize, family)
    for cycle in range(2):  # exact again after unparallelize and parallelize
        assert_exact([result["runs"][cycle] for result in results], cycle)
    for result in results:
        assert result["replaced"] == 0
        assert result["processors_restored"] and result["configs_left"] == 0
        assert result["model_config"] is None and result["instance_attributes"] == []


def settled_thread_count() -> int:
    """This process's thread count once it holds still for 0.1 s (at most 2 s): a thread that is already on its
    way out (gloo's, torch's) may still be counted just after ``unparallelize`` returns."""
    import time

    import psutil

    readings = [psutil.Process().num_threads()]
    for _ in range(100):
        if len(readings) >= 5 and len(set(readings[-5:])) == 1:
            break
        time.sleep(0.02)
        readings.append(psutil.Process().num_threads())
    return readings[-1]


def threads_after_cycles(cycles: int) -> list[int]:
    """This process's thread count after each parallelize / call / unparallelize cycle (garbage collected)."""
    import gc

    pipe, counts = build_pipeline("pixart"), []
    for _ in range(cycles):
        pipe = paradiff.parallelize(pipe, strategy="ulysses", cfg_parallel=True)
        generate(pipe, prompt_inputs(pipe, "pixart"), 64, 1)
        paradiff.unparallelize(pipe)
        gc.collect()
        counts.append(settled_thread_count())
    return counts


@pytest.mark.timeout(120)
def test_unparallelize_shuts_down_the_groups_it_made(pool4):
    """The world, CFG-pair, half and one-rank groups of ulysses × cfg at 4 ranks: gloo keeps threads per group,
    so groups left behind would add threads at every cycle (at least one per group, so 3 over the last 3 cycles).
    One thread more or less at one reading is allowed: torch and gloo start and end helper threads of their own."""
    for counts in pool4.run(threads_after_cycles, 4):
        assert max(counts[1:]) <= min(counts) + 1, counts


def size_error(family: str, size: int, text_tokens: int | None = None) -> dict:
    """A call whose tokens do not split fails with the same message on every rank; a good call still works."""
    pipe = paradiff.parallelize(build_pipeline(family), strategy="ulysses")
    message = ""
    try:
        generate(pipe, prompt_inputs(pipe, family, seq_len=text_tokens), size, 1)
    except ParadiffError as error:
        message = str(error)
    recovered = generate(pipe, prompt_inputs(pipe, family), 64, 1).shape
    paradiff.unparallelize(pipe)
    return {"message": message, "recovered": recovered, "rank": dist.get_rank()}


@pytest.mark.parametrize(
    ("family", "size", "text_tokens", "message"),
    [
        (
            "pixart",
            48,
            None,
            "strategy='ulysses' splits the image's 3×3 = 9 tokens (16 pixels per token) over 2 ranks, and 9 is not "
            "divisible by 2; use height 32 or 64 at this width",
        ),
        (
            "flux",
            64,
            7,
            "strategy='ulysses' splits the 7 prompt tokens of the flux joint attention over 2 ranks, and 7 is not "
            "divisible by 2; give the prompt a multiple of 2 tokens (e.g. with the pipeline's max_sequence_length)",
        ),
    ],
)
def test_sizes_that_do_not_split_fail_clearly(pool2, family, size, text_tokens, message):
    for result in pool2.run(size_error, family, size, text_tokens):
        assert result["message"] == message
        assert result["recovered"] == (1, 64, 64, 3)


@pytest.mark.parametrize(
    ("family", "world", "options", "message"),
    [
        (
            "flux",
            4,
            {"strategy": "ulysses"},
            r"strategy='ulysses' gives each of the 4 ranks 1 of FluxTransformer2DModel's 2 attention heads, which "
            r"would leave the last rank none of its own \(diffusers pads only that rank's\); run it on 2 ranks "
            r"\(per CFG half with cfg_parallel\), or use strategy='patch', .* on 4 ranks",
        ),
        (
            "sd",
            2,
            {"strategy": "ulysses"},
            r"strategy='ulysses' does not support UNet2DConditionModel: it needs diffusers' context parallelism "
            r"\(context_parallel\), which the unet family does not declare; supported: PixArtTransformer2DModel, "
            r"SD3Transformer2DModel, FluxTransformer2DModel, .*WanTransformer3DModel, .*any other transformer with "
            r"diffusers' `_cp_plan` \(strategy='patch', 'parastep', 'asyncdiff' or 'cfg' run UNet2DConditionModel\)",
        ),
        pytest.param(
            "pixart",
            2,
            {"strategy": "ring"},
            r"strategy='ring' does not run on CPU: ring attention merges partial attentions by their log-sum-exp, "
            r"and diffusers' only context-parallel attention backend on CPU \('native'\) cannot return it; "
            r"use strategy='ulysses' on CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="ring's CPU refusal"),
        ),
        (
            "pixart",
            2,
            {"strategy": "ulysses", "partial_context": 0.5},
            "partial_context is an option of the patch strategy, not of strategy='ulysses'; supported: ",
        ),
    ],
)
def test_unsupported_runs_fail_before_any_collective(monkeypatch, family, world, options, message):
    refused_before_any_collective(monkeypatch, family, world, message, **options)


def test_uneven_heads_in_diffusers_processors_need_diffusers_uneven_mode(monkeypatch):
    """Before diffusers 0.42 its Ulysses splits heads evenly only: Flux's stock processor is refused, PixArt (whose
    attention call paradiff makes and pads) is not."""
    monkeypatch.setattr("paradiff.strategies.sequence.ulysses_pads_heads", lambda: False)
    message = (
        r"FluxTransformer2DModel has 2, which diffusers .* cannot split unevenly \(0.42 pads them\); upgrade "
        r"diffusers, or run it on 2 ranks"
    )
    refused_before_any_collective(monkeypatch, "flux", 4, message, strategy="ulysses")
    paradiff.check_parallelize(build_pipeline("pixart"), strategy="ulysses", world_size=4)


def test_a_processor_without_pytorch_attention_is_refused_instead_of_attending_locally():
    """The classic ``AttnProcessor`` (``baddbmm``) never calls scaled_dot_product_attention: nothing to dispatch."""
    attn = build_pipeline("pixart").transformer.transformer_blocks[0].attn1
    attn.set_processor(AttnProcessor())
    comm = SimpleNamespace(size=2, record=lambda *args, **kwargs: None)
    hook = DispatchedSDPAHook("transformer_blocks.0.attn1", None, None, comm, "ulysses")
    HookRegistry.check_if_exists_or_initialize(attn).register_hook(hook, "test")
    message = r"'transformer_blocks\.0\.attn1' ran without PyTorch's scaled_dot_product_attention .*AttnProcessor\)"
    with pytest.raises(ParadiffError, match=message):
        attn(torch.zeros(1, 4, attn.inner_dim))


def test_an_unsupported_backend_fails_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe = build_pipeline("flux")
    for processor in pipe.transformer.attn_processors.values():
        processor._attention_backend = "_native_math"  # this instance only, unlike set_attention_backend
    with pytest.raises(ParadiffError, match=r"backend '_native_math' has no context-parallel support .*native"):
        paradiff.parallelize(pipe, strategy="ulysses")
    assert not dist.is_initialized()


def test_split_error_names_heights_that_work():
    transformer = build_pipeline("pixart").transformer
    family = family_of(transformer)
    assert sequence_split_error("ulysses", family, transformer, Grid(4, 4), None, 2, 8) is None
    message = sequence_split_error("ring", family, transformer, Grid(5, 6), None, 4, 8)  # 30 tokens over 4 ranks
    assert message.endswith("30 is not divisible by 4; use height 64 or 96 at this width")


def test_sequence_strategies_are_registered_as_exact():
    for name in ("ulysses", "ring"):
        assert name in strategy_names()
        assert strategy_class(name).name == name and strategy_class(name).uses_warmup is False
