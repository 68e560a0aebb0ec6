"""AsyncDiff (`asyncdiff`): the denoiser cut into components, one per rank, each one step behind the one before."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from displaced_reference import asyncdiff_reference
from exactness import assert_exact
from patch_cases import (
    against_one_device,
    displaced_vs_reference,
    flux_true_cfg_inputs,
    refused_before_any_collective,
    two_calls_do_not_share_state,
)

import paradiff
from paradiff import ParadiffError
from paradiff.layers.components import ComponentPlan
from paradiff.models import family_of
from paradiff.strategies import strategy_class, strategy_names, supported_combinations
from paradiff.tiny import build_pipeline, prompt_inputs


def asyncdiff_vs_one_device(family: str, size: int, steps: int, warmup: int, true_cfg: bool = False, **options):
    """One device vs ``strategy="asyncdiff"`` on this rank, with the counters and the cut it took
    (``output_type="latent"`` among ``options``: the final latents, what exact runs compare)."""
    pipe = build_pipeline(family)
    denoiser = getattr(pipe, "unet", None) or pipe.transformer
    inputs = flux_true_cfg_inputs(pipe) if true_cfg else prompt_inputs(pipe, family)
    units = family_of(denoiser).component_units(denoiser)

    def cut(pipe) -> dict:  # measured on the first call
        return {"cut": pipe._paradiff.strategy_part.installed.cut}

    result = against_one_device(pipe, inputs, size, steps, cut, strategy="asyncdiff", warmup_steps=warmup, **options)
    return {**result, "skips": {k: sorted(v) for k, v in units.skips.items()}}


def _per_step(result) -> dict:
    return {row["step"]: row for row in result["stats"]["per_step"]}


def _check_exact(results) -> None:
    assert_exact(results)
    for result in results:
        assert result["restored_error"] == 0.0
        assert result["class_changed"] and result["class_restored"] and result["hooks_left"] == 0
        assert result["stats"]["bytes_per_step"] == 0  # warm-up: every rank ran the whole model, nothing moved


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["sd", "sdxl", "pixart", "sd3", "flux"])
def test_exact_during_warmup_at_2_ranks(pool2, family):
    steps = 2
    _check_exact(pool2.run(asyncdiff_vs_one_device, family, 64, steps, warmup=steps, output_type="latent"))


@pytest.mark.timeout(300)
def test_stride_2_exact_during_warmup_at_4_ranks(pool4):
    """3 components and the extra rank (on the 4-rank pool the suite starts anyway, rather than a pool of 3)."""
    steps = 2
    results = pool4.run(
        asyncdiff_vs_one_device, "sd", 64, steps, warmup=steps, asyncdiff_stride=2, output_type="latent"
    )
    _check_exact(results)
    assert all(len(result["cut"]) == 3 for result in results)


def _check_displaced(results, warmup: int, steps: int, min_psnr: float) -> None:
    for result in results:
        assert np.isfinite(result["image"]).all() and result["max_error"] > 1e-6
        assert result["psnr_db"] > min_psnr, result["psnr_db"]
        assert result["restored_error"] == 0.0 and result["hooks_left"] == 0
        assert all(row["bytes_sent"] == 0 for step, row in _per_step(result).items() if step <= warmup)
    for result in results[1:]:
        np.testing.assert_array_equal(result["image"], results[0]["image"])  # one prediction per step everywhere
        assert result["cut"] == results[0]["cut"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["sd", "pixart", "sd3"])
def test_displaced_runs_close_and_sends_only_its_component(pool2, family):
    steps, warmup = 5, 2
    results = pool2.run(asyncdiff_vs_one_device, family, 64, steps, warmup=warmup)
    _check_displaced(results, warmup, steps, min_psnr=15.0)
    assert all(result["stats"]["layout"] == {"asyncdiff_cut": list(result["cut"])} for result in results)
    first, last = results
    for step in range(warmup + 1, steps):
        # rank 0 sends its component's outputs to rank 1, nothing else; rank 1 only broadcasts the prediction
        assert _per_step(first)[step]["stage_transfers"] > 0
        assert _per_step(last)[step]["stage_transfers"] == 0
        channels = {"sd": 4, "pixart": 8, "sd3": 16}[family]
        assert _per_step(last)[step]["bytes_sent"] == 2 * 8 * 8 * channels * 4  # CFG batch, fp32
    sent = {_per_step(first)[step]["bytes_sent"] for step in range(warmup + 1, steps)}
    assert len(sent) == 1  # the same outputs every displaced step
    if family == "pixart":  # the last block's output of component 0: 16 tokens of width 32, CFG batch
        assert sent == {2 * 16 * 32 * 4}
    if family == "sd3":  # joint blocks: the image tokens and the 8 text tokens go on
        assert sent == {2 * (16 + 8) * 32 * 4}


@pytest.mark.timeout(300)
def test_flux_true_cfg_keeps_buffers_per_call_context(pool2):
    steps, warmup = 4, 1
    results = pool2.run(asyncdiff_vs_one_device, "flux", 64, steps, warmup=warmup, true_cfg=True)
    _check_displaced(results, warmup, steps, min_psnr=15.0)
    exact = pool2.run(asyncdiff_vs_one_device, "flux", 64, 2, warmup=2, true_cfg=True, output_type="latent")
    _check_exact(exact)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "cut"), [("sd", (4, 3)), ("sd3", (1, 1))])
def test_displaced_steps_move_bytes_and_match_the_reference(pool2, family, cut):
    """Displaced steps send each component's outputs on, and land on the reference's latents (not one device's):
    a skipped transfer, or outputs one step older or newer than the reference's, moves them far past round-off."""
    reference = partial(asyncdiff_reference, cut=cut, warmup_steps=1)
    options = {"strategy": "asyncdiff", "warmup_steps": 1, "asyncdiff_cut": cut}
    results = pool2.run(displaced_vs_reference, family, 5, reference, **options)
    assert_exact(results)  # "error" here: to the displaced reference
    for result in results:
        assert result["sent"] > 0, result["sent"]
        assert result["moved"] >= 1e-3, result["moved"]  # displaced: not the one-device latents


@pytest.mark.timeout(300)
def test_stride_2_displaced_at_4_ranks(pool4):
    steps, warmup = 6, 1
    results = pool4.run(asyncdiff_vs_one_device, "sd", 64, steps, warmup=warmup, asyncdiff_stride=2)
    _check_displaced(results, warmup, steps, min_psnr=10.0)
    rows = [_per_step(result) for result in results]
    for step in range(warmup + 1, steps):
        computes = (step - warmup - 1) % 2 == 0
        assert (rows[0][step]["stage_transfers"] > 0) == computes  # sends on a round's first call only
        assert rows[-1][step]["stage_transfers"] == 0  # the extra rank sends only the prediction


@pytest.mark.timeout(300)
def test_a_cut_given_by_the_user(pool2):
    results = pool2.run(asyncdiff_vs_one_device, "sd", 64, 4, warmup=1, asyncdiff_cut=(5, 2))
    _check_displaced(results, 1, 4, min_psnr=10.0)
    assert all(result["cut"] == (5, 2) for result in results)
    assert all(result["stats"]["layout"] == {"asyncdiff_cut": [5, 2]} for result in results)


@pytest.mark.timeout(300)
def test_stale_outputs_never_cross_calls(pool2):
    """Another size and prompt before: the buffers are planned again and nothing of the first call leaks in."""
    for result in pool2.run(two_calls_do_not_share_state, "pixart", 64, 4, 1, first_size=128, strategy="asyncdiff"):
        assert result["difference"] == 0.0


@pytest.mark.timeout(300)
def test_cfg_parallel_times_asyncdiff_at_4_ranks(pool4):
    """The CFG split wraps the components: each half runs on its own 2 ranks (warm-up moves only the halves)."""
    results = pool4.run(
        asyncdiff_vs_one_device, "sd", 64, 3, warmup=1, cfg_parallel=True, asyncdiff_cut=(4, 3), timeout_s=280
    )
    for result in results:
        assert np.isfinite(result["image"]).all() and result["psnr_db"] > 15.0 and result["max_error"] > 1e-6
        assert result["stats"]["cfg_gathers"] == 3 and result["restored_error"] == 0.0
    assert sum(result["stats"]["stage_transfers"] for result in results) > 0


def test_plan_carries_the_unet_skip_features():
    pipe = build_pipeline("sd")
    units = family_of(pipe.unet).component_units(pipe.unet)
    assert [name for name, _ in units.units][3] == "mid_block"
    assert units.skips == {4: {1, 2}, 5: {0, 1}, 6: {0}}
    first, second = (ComponentPlan.build((3, 4), units, rank, 1) for rank in (0, 1))
    assert first.targets == {0: [1], 1: [1], 2: [1]}  # down blocks: the chain input and skip features
    assert second.sources == {0: 0, 1: 0, 2: 0}
    ahead = [ComponentPlan.build((4, 3), units, rank, 2) for rank in (0, 1, 2)]
    assert ahead[0].targets == {0: [1, 2], 1: [1, 2], 2: [1, 2], 3: [1, 2]}  # the extra rank reads them too
    assert ahead[2].targets == {} and ahead[2].sources == ahead[1].sources and ahead[2].output_rank == 2


@pytest.mark.parametrize(
    ("family", "world", "options", "message"),
    [
        (
            "pixart",
            4,
            {},
            r"gives each of its 4 components at least one block, but this PixArtTransformer2DModel has 2 "
            r"\(transformer_blocks.0, transformer_blocks.1\); run at most 2 ranks",
        ),
        (
            "sd",
            2,
            {"asyncdiff_cut": (3, 3)},
            r"asyncdiff_cut=\[3, 3\] gives 2 components of 6 blocks, .* this UNet2DConditionModel has 7 blocks "
            r"\(down_blocks.0, .*, mid_block, .*\); give 2 block counts adding up to 7",
        ),
        (
            "sd",
            2,
            {"asyncdiff_stride": 2},
            r"asyncdiff_stride=2 runs N >= 2 components on N \+ 1 ranks, got 2; launch 3 or more ranks, or use "
            r"asyncdiff_stride=1",
        ),
        (
            "sd",
            3,
            {"asyncdiff_stride": 2, "asyncdiff_cut": (2, 2, 3)},
            r"asyncdiff_cut=\[2, 2, 3\] gives 3 components .* asyncdiff_stride=2 on 3 ranks runs 2 components",
        ),
    ],
)
def test_unsupported_runs_fail_before_any_collective(monkeypatch, family, world, options, message):
    refused_before_any_collective(monkeypatch, family, world, message, strategy="asyncdiff", **options)


def test_a_family_without_units_names_the_supported_classes():
    """A family that says nothing about its units (as a future family might) is refused, naming those that work."""

    class NoUnits(type(family_of(build_pipeline("sd").unet))):
        def component_units(self, model):
            return None

    pipe = build_pipeline("sd")
    config = paradiff.ParallelConfig(strategy="asyncdiff")
    supported = "UNet2DConditionModel, UNetMotionModel, .*PixArtTransformer2DModel, SD3Transformer2DModel, Flux"
    with pytest.raises(ParadiffError, match=f"does not support UNet2DConditionModel: .*; supported: {supported}"):
        strategy_class("asyncdiff").check_model(pipe.unet, NoUnits(), 2, config)


def test_options_belong_to_asyncdiff():
    with pytest.raises(ParadiffError, match="asyncdiff_stride is an option of the asyncdiff strategy, not of"):
        paradiff.ParallelConfig(strategy="patch", asyncdiff_stride=2)
    with pytest.raises(ParadiffError, match="asyncdiff_stride must be 1 or 2, got 3"):
        paradiff.ParallelConfig(strategy="asyncdiff", asyncdiff_stride=3)
    with pytest.raises(ParadiffError, match="asyncdiff_cut must be None or the number of units of each component"):
        paradiff.ParallelConfig(strategy="asyncdiff", asyncdiff_cut=(2, 0))
    assert "asyncdiff" in strategy_names() and "'asyncdiff'" in supported_combinations()
    assert strategy_class("asyncdiff").uses_warmup
