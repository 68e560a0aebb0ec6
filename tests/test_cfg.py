"""CFG split: the two batch halves on two groups of ranks, alone and composed with `patch` (2 × 2 mesh)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from exactness import assert_exact, latents, relative_error
from patch_cases import check_exact_and_restored, generate, parallel_vs_one_device

import paradiff
from paradiff import ParadiffError
from paradiff.layers.batch_split import CfgSplitHook
from paradiff.models import family_of
from paradiff.models.base import bind_inputs
from paradiff.runtime.step_state import StepState
from paradiff.tiny import build_pipeline, pipeline, prompt_inputs


def decode_one_latent(pipe) -> dict:
    """The compared calls return latents and decode nothing: decode one through the parallelized VAE instead."""
    with torch.no_grad():
        pipe.vae.decode(torch.randn(1, pipe.vae.config.latent_channels, 8, 8, generator=torch.Generator()))
    return {}


def _exact_run(pool, family: str, steps: int, warmup: int, **options) -> list[dict]:
    """Every rank's latents against one device's, with one decode through the parallelized VAE."""
    return pool.run(
        parallel_vs_one_device, family, 64, steps, warmup, output_type="latent", inspect=decode_one_latent, **options
    )


def _check_exact(results, steps, patch: bool):
    check_exact_and_restored(results, steps)
    for result in results:
        stats = result["stats"]
        assert stats["cfg_gathers"] == steps  # one gather of the two halves per denoiser call
        assert (stats["sync_layer_exchanges"] > 0) == patch
        assert stats["vae_decode_bytes"] > 0  # the decode is banded over every rank, cfg split or not


@pytest.mark.parametrize(
    ("family", "options"),
    [
        pytest.param("sd", {}, id="sd-ddim"),
        pytest.param("sd", {"scheduler": "euler", "batch": 2}, id="sd-euler-batch2"),
        pytest.param("sdxl", {"scheduler": "dpm"}, id="sdxl-dpm-added-cond-kwargs"),
        pytest.param("pixart", {}, id="pixart-dpm-attention-mask"),
        pytest.param("sd3", {}, id="sd3-flow-pooled-projections"),
        pytest.param("flux", {"batch": 2}, id="flux-even-batch-without-cfg"),
    ],
)
def test_cfg_alone_is_exact_at_2_ranks(pool2, family, options):
    steps = 3
    _check_exact(_exact_run(pool2, family, steps, 0, strategy="cfg", **options), steps, patch=False)


@pytest.mark.parametrize("family", ["sd", "pixart"])
def test_cfg_times_patch_is_exact_at_4_ranks(pool4, family):
    steps = 2
    _check_exact(_exact_run(pool4, family, steps, steps, cfg_parallel=True), steps, patch=True)


def test_cfg_times_patch_displaced_stays_close(pool4):
    steps, warmup = 5, 1
    results = pool4.run(parallel_vs_one_device, "sd", 64, steps, warmup=warmup, cfg_parallel=True)
    for result in results:
        rows = result["stats"]["per_step"]
        assert all(row["sync_layer_exchanges"] == 0 and row["stale_layer_exchanges"] > 0 for row in rows[warmup + 1 :])
        assert result["stats"]["cfg_gathers"] == steps
        assert result["max_error"] > 1e-6 and result["psnr_db"] > 30.0
    for result in results[1:]:
        np.testing.assert_array_equal(result["image"], results[0]["image"])


@pytest.mark.parametrize(
    ("ranks", "options"),
    [
        (2, {"strategy": "cfg"}),
        (4, {"strategy": "patch", "cfg_parallel": True}),
        (4, {"strategy": "parastep", "cfg_parallel": True}),
    ],
    ids=["cfg", "patch-x-cfg", "parastep-x-cfg"],
)
def test_two_call_guidance_runs_one_call_per_group_exactly(rank_pool, ranks, options):
    """Flux true CFG makes a 'cond' and an 'uncond' call per step: each CFG group runs one of them."""
    steps = 3
    results = rank_pool(ranks).run(
        parallel_vs_one_device, "flux", 64, steps, warmup=steps, true_cfg=True, output_type="latent", **options
    )
    assert_exact(results)
    for result in results:
        assert result["restored_error"] == 0.0 and result["class_restored"] and result["hooks_left"] == 0
        # the first step runs both calls everywhere (it shows that every step makes both); then one gather a step
        assert result["stats"]["cfg_gathers"] == steps - 1


def cogvideox_vs_one_device(steps: int, **options) -> dict:
    """A video DiT no family describes (CogVideoX batches CFG in one call), one device vs ``parallelize`` (latents)."""
    pipe = pipeline("cogvideox-text")

    def video():
        call = {"num_inference_steps": steps, "num_frames": 5, "height": 32, "width": 32, "output_type": "latent"}
        return latents(pipe("a red circle", generator=torch.Generator().manual_seed(0), **call))

    reference = video()
    pipe = paradiff.parallelize(pipe, **options)
    parallel = video()
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    return {"error": relative_error(parallel, reference), "output": parallel, "stats": stats}


@pytest.mark.parametrize(
    ("ranks", "options"),
    [(2, {"strategy": "cfg"}), (4, {"strategy": "parastep", "cfg_parallel": True, "warmup_steps": 3})],
    ids=["cfg", "parastep-x-cfg"],
)
def test_the_cfg_split_runs_a_denoiser_no_family_describes(rank_pool, ranks, options):
    steps = 3
    results = rank_pool(ranks).run(cogvideox_vs_one_device, steps, **options)
    assert_exact(results)
    for result in results:
        assert result["stats"]["cfg_gathers"] == steps  # the halves really ran apart


def odd_batch_error(case: str) -> dict:
    """A call whose batch does not split in two fails on every rank; a good call afterwards still works."""
    family = "flux" if case.startswith("flux") else "sd"
    pipe = paradiff.parallelize(build_pipeline(family), strategy="cfg")
    inputs = prompt_inputs(pipe, family)
    if case == "sd-guidance-off":
        inputs["guidance_scale"] = 1.0
    message = ""
    try:
        generate(pipe, inputs, 64, 2)
    except ParadiffError as error:
        message = str(error)
    recovered = generate(pipe, prompt_inputs(pipe, "sd"), 64, 2).shape if family == "sd" else None
    paradiff.unparallelize(pipe)
    return {"message": message, "recovered": recovered}


@pytest.mark.parametrize("case", ["sd-guidance-off", "flux-distilled-guidance"])
def test_calls_without_a_cfg_batch_fail_clearly(pool2, case):
    for result in pool2.run(odd_batch_error, case):
        message = r"this call has a batch of 1 and no second call to pair with\. Supported: pipelines that batch .*SD"
        assert re.search(message, result["message"])
        assert result["message"].startswith("strategy='cfg' splits each denoiser call's batch")
        assert "generate an even number of images, or use strategy='patch' or 'parastep' instead" in result["message"]
        if case.startswith("sd"):
            assert result["recovered"] == (1, 64, 64, 3)


@pytest.mark.parametrize(
    ("world", "options", "message"),
    [
        (3, {"cfg_parallel": True}, r"cfg_parallel needs an even world size, got 3: .*launch 2 or 4 ranks"),
        (4, {"strategy": "cfg"}, r"strategy='cfg' runs the two CFG halves on 2 ranks, got a world of 4; .*patch"),
    ],
)
def test_world_that_does_not_fit_fails_before_any_collective(monkeypatch, world, options, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # no process group exists: it must fail before creating one
    pipe = build_pipeline("sd")
    with pytest.raises(ParadiffError, match=message):
        paradiff.parallelize(pipe, **options)
    assert not hasattr(pipe, "_paradiff")


def test_config_degrees_and_combinations():
    assert paradiff.ParallelConfig().degrees(4) == (1, 4)
    assert paradiff.ParallelConfig(cfg_parallel=True).degrees(4) == (2, 2)
    assert paradiff.ParallelConfig(cfg_parallel=True).degrees(2) == (2, 1)  # patch over 1 rank: the split alone
    assert paradiff.ParallelConfig(strategy="cfg").cfg_parallel  # cfg alone is the split; asking twice is the same
    assert paradiff.ParallelConfig(strategy="cfg", cfg_parallel=True).degrees(2) == (2, 1)
    with pytest.raises(ParadiffError, match="partial_context is an option of the patch strategy.*supported: "):
        paradiff.ParallelConfig(strategy="cfg", partial_context=0.5)


def test_split_cuts_batched_arguments_only():
    """Every tensor with the latent's batch is cut (also in dicts); Flux's token ids never, whatever their length."""
    transformer = build_pipeline("flux").transformer
    hook = CfgSplitHook(family_of(transformer), SimpleNamespace(rank=1, state=StepState(0)))
    latent = torch.arange(2.0).view(2, 1, 1).expand(2, 4, 64)
    args, kwargs = hook.halve(
        bind_inputs(
            transformer,
            (),
            dict(
                hidden_states=latent,
                timestep=torch.tensor([1.0, 1.0]),
                img_ids=torch.zeros(2, 3),  # 2 tokens: the same length as the batch
                txt_ids=torch.zeros(2, 3),
                joint_attention_kwargs={"extra": [torch.ones(2, 5)], "scale": 1.0},
            ),
        )
    )
    kwargs = bind_inputs(transformer, args, kwargs).arguments
    assert torch.equal(kwargs["hidden_states"], latent[1:])
    assert kwargs["timestep"].shape == (1,)
    assert kwargs["img_ids"].shape == kwargs["txt_ids"].shape == (2, 3)
    assert kwargs["joint_attention_kwargs"]["extra"][0].shape == (1, 5)
    assert kwargs["joint_attention_kwargs"]["scale"] == 1.0


def test_an_odd_batch_under_cfg_parallel_names_the_composed_split():
    """Composed with another strategy, the remedy is to drop cfg_parallel (strategy='cfg' alone: another strategy)."""
    transformer = build_pipeline("flux").transformer
    hook = CfgSplitHook(family_of(transformer), SimpleNamespace(rank=0, state=StepState(0)))
    hook.fn_ref = SimpleNamespace(original_forward=lambda *args, **kwargs: (torch.zeros(1, 4, 64),))
    call = {"hidden_states": torch.zeros(1, 4, 64), "return_dict": False}
    hook.new_forward(transformer, timestep=torch.tensor([1.0]), **call)  # the first step runs whole: one call
    with pytest.raises(ParadiffError, match=r"^cfg_parallel splits .* 1 and no .*or run without cfg_parallel$"):
        hook.new_forward(transformer, timestep=torch.tensor([0.5]), **call)


def test_two_call_guidance_under_displaced_patch_stays_close(pool4):
    """After warm-up, each group's patch runs displaced on its own call of the pair; every rank ends alike."""
    steps, warmup = 5, 1
    results = pool4.run(
        parallel_vs_one_device, "flux", 64, steps, warmup=warmup, true_cfg=True, strategy="patch", cfg_parallel=True
    )
    for result in results:
        assert result["stats"]["stale_layer_exchanges"] > 0
        assert result["max_error"] > 1e-6 and result["psnr_db"] > 30.0
    for result in results[1:]:
        np.testing.assert_array_equal(result["image"], results[0]["image"])
