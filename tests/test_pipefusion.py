"""PipeFusion (`pipefusion`): stages of DiT blocks on the ranks, patches of token rows flowing through them."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from patch_cases import (
    against_one_device,
    check_exact_and_restored,
    expect_error,
    generate,
    refused_before_any_collective,
    two_calls_do_not_share_state,
)

import paradiff
from paradiff import ParadiffError
from paradiff.models import family_of
from paradiff.stages.blocks import CFG_HALVES_DRAIN, plan_patches, stage_blocks
from paradiff.stages.cut import balanced_cut
from paradiff.strategies import strategy_class, strategy_names, supported_combinations
from paradiff.tiny import build_pipeline, prompt_inputs


def deeper_pipeline(family: str, blocks: int | None = None):
    """The tiny pipeline of ``family``, with a transformer of ``blocks`` blocks (seeded: the same on every rank)."""
    pipe = build_pipeline(family)
    if blocks is None:
        return pipe
    model = pipe.transformer
    layers = {"num_layers": blocks}
    if family == "flux":
        layers = {"num_layers": blocks // 2, "num_single_layers": blocks - blocks // 2}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        pipe.transformer = type(model).from_config({**model.config, **layers}).eval()
    return pipe


def parameter_counts(model) -> dict:
    """Parameters resident in ``model`` (freed ones hold no elements): in its blocks, the largest block, the rest."""
    blocks = [block for _, block in stage_blocks(model, family_of(model).block_stack)]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    return {
        "blocks": sum(p.numel() for p in model.parameters() if id(p) in in_blocks),
        "largest_block": max(sum(p.numel() for p in block.parameters()) for block in blocks),
        "others": sum(p.numel() for p in model.parameters() if id(p) not in in_blocks),
    }


def pipefusion_vs_one_device(
    family: str, size: int, steps: int, warmup: int, blocks: int | None = None, strategy: str = "pipefusion", **options
):
    """One device vs ``strategy`` on this rank; also the parameters each rank holds and the restored weights
    (``output_type="latent"`` among ``options``: the final latents, what exact runs compare)."""
    pipe = deeper_pipeline(family, blocks)
    model = pipe.transformer
    inputs = prompt_inputs(pipe, family)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    before = parameter_counts(model)

    def held(pipe) -> dict:
        return {
            "resident": parameter_counts(model),
            "cut": getattr(pipe._paradiff.strategy_part.installed, "cut", None),
        }

    result = against_one_device(pipe, inputs, size, steps, held, strategy=strategy, warmup_steps=warmup, **options)
    return {
        **result,
        "weights_restored": all(torch.equal(p, weights[name]) for name, p in model.named_parameters()),
        "before": before,
        "device": str(model.device),
    }


def _check_exact(results, steps: int, samples: int, cfg_gathers: int = 0) -> None:
    """Exact, restored, and each call passed its ``samples`` (the batch of a stage pipeline's call) one by one as
    whole sequences: one transfer per sample and step from each stage but the last."""
    check_exact_and_restored(results, steps)
    for result in results:
        stats = result["stats"]
        assert result["weights_restored"]
        assert stats["cfg_gathers"] == cfg_gathers
        assert stats["sync_layer_exchanges"] == 0 and 0.0 <= stats["idle_share"] < 1.0
    transfers = {row["stage_transfers"] for r in results for row in r["stats"]["per_step"]}
    assert transfers == {0, samples}, transfers


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["pixart", "sd3", "flux"])
def test_exact_at_2_ranks(pool2, family):
    steps = 2
    results = pool2.run(pipefusion_vs_one_device, family, 64, steps, warmup=steps, output_type="latent")
    _check_exact(results, steps, samples=1 if family == "flux" else 2)  # batched CFG: 2 samples per call


@pytest.mark.timeout(300)
def test_exact_at_4_ranks(pool4):
    steps = 2
    results = pool4.run(pipefusion_vs_one_device, "pixart", 64, steps, warmup=steps, blocks=4, output_type="latent")
    _check_exact(results, steps, samples=2)
    assert all(result["cut"] == (1, 1, 1, 1) for result in results)


@pytest.mark.timeout(300)
def test_cfg_times_pipefusion_is_exact_at_4_ranks(pool4):
    steps = 2
    results = pool4.run(
        pipefusion_vs_one_device, "sd3", 64, steps, warmup=steps, cfg_parallel=True, output_type="latent"
    )
    _check_exact(results, steps, samples=1, cfg_gathers=steps)  # each group runs one half of the batch
    assert all(r["stats"]["flow"]["stopped"] == CFG_HALVES_DRAIN for r in results)  # the halves are apart
    bands = pool4.run(
        pipefusion_vs_one_device,
        "sd3",
        64,
        steps,
        warmup=steps,
        cfg_parallel=True,
        pipefusion_sync="sequence",
        output_type="latent",
    )
    check_exact_and_restored(bands, steps)  # row bands within each CFG group
    assert all(r["stats"]["sync_layer_exchanges"] > 0 and r["stats"]["cfg_gathers"] == steps for r in bands)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["pixart", "sd3", "flux"])
def test_exact_in_row_bands_at_2_ranks(pool2, family):
    """``pipefusion_sync="sequence"``: exact calls run every block on each rank's band of rows, gathering each
    attention layer's K/V; equal to one device, with every block kept on every rank and no stage transfers."""
    steps = 2
    results = pool2.run(
        pipefusion_vs_one_device, family, 64, steps, warmup=steps, pipefusion_sync="sequence", output_type="latent"
    )
    check_exact_and_restored(results, steps)
    for result in results:
        assert result["resident"]["blocks"] == result["before"]["blocks"]  # nothing released
        assert result["stats"]["sync_layer_exchanges"] > 0
        assert {row["stage_transfers"] for row in result["stats"]["per_step"]} == {0}


@pytest.mark.timeout(300)
def test_exact_in_row_bands_at_4_ranks(pool4):
    steps = 2
    results = pool4.run(
        pipefusion_vs_one_device,
        "pixart",
        64,
        steps,
        warmup=steps,
        blocks=4,
        pipefusion_sync="sequence",
        output_type="latent",
    )
    check_exact_and_restored(results, steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_displaced_calls_after_row_band_warm_up_are_the_stages_ones(pool2, family):
    """The warm-up in row bands leaves each stage's K/V buffers as the stage pipeline's warm-up does (within float
    round-off), so the displaced calls after it compute what they compute after the stages' warm-up."""
    steps, warmup, blocks = 4, 1, 4
    runs = {
        sync: pool2.run(
            pipefusion_vs_one_device,
            family,
            128,
            steps,
            warmup=warmup,
            blocks=blocks,
            pipefusion_sync=sync,
            output_type="latent",
        )
        for sync in ("stages", "sequence")
    }
    for stages, sequence in zip(runs["stages"], runs["sequence"], strict=True):
        assert stages["max_error"] > 1e-6  # displaced: not one device's
        scale = np.abs(stages["image"]).max()
        assert np.abs(stages["image"] - sequence["image"]).max() <= 1e-5 * scale
    assert _per_step(runs["sequence"][0])[steps - 1]["stage_transfers"] == 4  # displaced: stage 0 sends 4 patches
    np.testing.assert_array_equal(runs["sequence"][0]["image"], runs["sequence"][1]["image"])


def edited_latents(edit_at: int, steps: int, warmup: int) -> dict:
    """This rank's final latents, flowing and draining, with a callback that scales the latents after step
    ``edit_at``, and the flowing run's ``flow`` counters."""

    def edit(step: int, timestep, latents: torch.Tensor) -> None:  # PixArt's callback may edit them in place
        if step == edit_at:
            latents.mul_(1.01)

    pipe = build_pipeline("pixart", scheduler="ddim")
    call = {**prompt_inputs(pipe, "pixart"), "callback": edit, "callback_steps": 1}
    runs = {}
    for flow in (True, False):
        pipe = paradiff.parallelize(pipe, strategy="pipefusion", warmup_steps=warmup, pipefusion_flow=flow)
        try:
            runs[flow] = generate(pipe, call, 64, steps, output_type="latent")
            runs[f"stats_{flow}"] = paradiff.comm_stats(pipe)["flow"]
        finally:
            paradiff.unparallelize(pipe)
    return {"flowing": runs[True], "draining": runs[False], "flow": runs["stats_True"]}


@pytest.mark.timeout(300)
def test_a_callback_that_edits_latents_makes_the_pipeline_drain(pool2):
    """The next call's latent is worked out ahead; a callback that changes it shows in the call the pipeline then
    makes: the work ahead is undone, that call and the later ones drain, and the result is draining's, bit for bit."""
    for result in pool2.run(edited_latents, 2, 5, 1):
        np.testing.assert_array_equal(result["flowing"], result["draining"])
        assert result["flow"]["calls_flowing"] == 1  # call 2 flowed into call 3, which then differed
        assert result["flow"]["stopped"].startswith("at step 3 the pipeline's call differed from the one worked out")


@pytest.mark.timeout(300)
def test_each_rank_holds_its_stage_only(pool2):
    """4 blocks on 2 ranks: at most half the blocks' parameters (+ one block of rounding), all the rest."""
    results = pool2.run(pipefusion_vs_one_device, "flux", 64, 2, warmup=2, blocks=4)
    for result in results:
        before, resident = result["before"], result["resident"]
        assert resident["blocks"] <= before["blocks"] / 2 + before["largest_block"]
        assert resident["blocks"] < before["blocks"]
        assert resident["others"] == before["others"]  # embeddings and head stay whole on every rank
        assert result["device"] == "cpu"
    assert sum(r["resident"]["blocks"] for r in results) == results[0]["before"]["blocks"]


@pytest.mark.timeout(300)
def test_a_cut_given_by_the_user(pool2):
    results = pool2.run(
        pipefusion_vs_one_device, "pixart", 64, 2, warmup=2, blocks=4, pipefusion_stages=(1, 3), output_type="latent"
    )
    _check_exact(results, 2, samples=2)
    block = results[0]["before"]["blocks"] // 4
    assert [r["resident"]["blocks"] for r in results] == [block, 3 * block]


def _per_step(result) -> dict:
    return {row["step"]: row for row in result["stats"]["per_step"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["pixart", "sd3", "flux"])
def test_displaced_runs_close_and_moves_few_bytes(pool2, family):
    """After warm-up the patches flow through the stages: close to one device, and few bytes next to `patch`."""
    steps, warmup, blocks = 4, 1, 4
    pipefusion = pool2.run(pipefusion_vs_one_device, family, 128, steps, warmup=warmup, blocks=blocks)
    for result in pipefusion:
        rows = _per_step(result)
        samples = 1 if family == "flux" else 2  # warm-up: each sample's whole sequence, one after the other
        assert all(row["stage_transfers"] <= samples for step, row in rows.items() if step <= warmup)
        assert result["max_error"] > 1e-6 and np.isfinite(result["image"]).all()
        assert result["psnr_db"] > 30.0
        assert result["weights_restored"] and result["restored_error"] == 0.0
    assert _per_step(pipefusion[0])[steps - 1]["stage_transfers"] == 4  # 128 px: 8 token rows, 4 patches on 2 stages
    np.testing.assert_array_equal(pipefusion[0]["image"], pipefusion[1]["image"])
    if family == "pixart":  # the same model under `patch`: K/V of every layer instead of the stage borders
        patch = pool2.run(pipefusion_vs_one_device, family, 128, steps, warmup, blocks, strategy="patch")
        last = steps - 1
        ours = max(_per_step(r)[last]["bytes_sent"] for r in pipefusion)
        theirs = max(_per_step(r)[last]["bytes_sent"] for r in patch)
        print(f"{family}: bytes per displaced step per rank, pipefusion {ours}, patch {theirs}")
        assert ours <= theirs / blocks


class _Counter(ModelHook):
    def __init__(self, counts: dict, name: str):
        super().__init__()
        self.counts, self.name = counts, name

    def pre_forward(self, module, *args, **kwargs):
        self.counts[self.name] = self.counts.get(self.name, 0) + args[0].shape[0]  # samples projected
        return args, kwargs


def prompt_projections_computed(steps: int) -> dict:
    """How many samples' prompts each cross-attention's ``to_k`` of this rank's stage and the caption projection
    really projected (hooks registered before paradiff's, so inside them), and the patches per displaced call."""
    pipe = deeper_pipeline("pixart", 4)
    counts: dict = {}
    for name, module in pipe.transformer.named_modules():
        if name.endswith("attn2.to_k") or name == "caption_projection":
            HookRegistry.check_if_exists_or_initialize(module).register_hook(_Counter(counts, name), "count")
    pipe = paradiff.parallelize(pipe, strategy="pipefusion", warmup_steps=1)
    counts.clear()  # the stage cut's measurement ran the blocks too
    generate(pipe, prompt_inputs(pipe, "pixart"), 128, steps)
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    patches = stats["per_step"][-1]["stage_transfers"]
    return {"computed": {name: n for name, n in counts.items() if n}, "patches": patches}


@pytest.mark.timeout(300)
def test_each_call_projects_the_prompt_once_per_layer(pool2):
    """The prompt's keys are the same for every patch of a call: computed once per call, not once per patch, and
    the prompt is embedded once per call, not again in the forwards that work out patches ahead (each call
    projects the batch's 2 prompts, CFG's, as one device does; warm-up calls pass them one by one)."""
    steps = 4
    results = pool2.run(prompt_projections_computed, steps)
    assert results[0]["patches"] == 4  # 128 px: stage 0 sends 4 patches per displaced call
    for result in results:
        assert len(result["computed"]) == 3  # this rank's 2 of the 4 blocks, and the caption projection
        assert set(result["computed"].values()) == {2 * steps}, result["computed"]


@pytest.mark.timeout(300)
def test_stale_buffers_never_cross_calls(pool2):
    four_blocks = functools.partial(deeper_pipeline, blocks=4)
    for result in pool2.run(
        two_calls_do_not_share_state, "pixart", 128, 4, 1, build=four_blocks, strategy="pipefusion"
    ):
        assert result["difference"] == 0.0


@pytest.mark.timeout(120)
def test_rows_that_do_not_divide_into_patches_fail_clearly(pool2):
    message = (
        "pipefusion_patches=3 cuts the image into 3 patches of whole token rows, but height 64 has 4 rows of 16 "
        "pixels, which is not divisible by 3; use height 48 or 96, or pipefusion_patches=2 or 4 at this height"
    )
    results = pool2.run(expect_error, "pixart", "height=64", strategy="pipefusion", pipefusion_patches=3)
    assert results == [message, message]
    bands = (
        "pipefusion_sync='sequence' runs exact calls in bands of whole token rows, one per rank, but height 48 has 3 "
        "rows of 16 pixels, which is not divisible by 2 ranks; use height 32 or 64"
    )
    results = pool2.run(expect_error, "pixart", "height=48", strategy="pipefusion", pipefusion_sync="sequence")
    assert results == [bands, bands]


@pytest.mark.parametrize(
    ("family", "world", "options", "message"),
    [
        (
            "sd",
            2,
            {},
            r"strategy='pipefusion' does not support UNet2DConditionModel: it needs its transformer blocks as one "
            r"chain \(block_stack\), which the unet family does not declare; supported: PixArtTransformer2DModel, "
            r"SD3Transformer2DModel, FluxTransformer2DModel, .*"
            r"WanTransformer3DModel, .* \(strategy='patch', 'parastep', 'asyncdiff' or 'cfg' run "
            r"UNet2DConditionModel\)",
        ),
        (
            "pixart",
            4,
            {},
            r"gives each of its 4 stages \(one per rank\) at least one block, but this PixArtTransformer2DModel has 2 "
            r"transformer blocks; run it on at most 2 ranks",
        ),
        (
            "pixart",
            4,
            {"pipefusion_patches": 2},
            r"pipefusion_patches=2 is fewer than the 4 pipeline stages \(one per rank\): .* pipefusion_patches >= 4",
        ),
        (
            "pixart",
            2,
            {"pipefusion_stages": (1, 2)},
            r"pipefusion_stages=\[1, 2\] cuts 3 blocks, but this PixArtTransformer2DModel has 2 transformer blocks",
        ),
        (
            "pixart",
            4,
            {"pipefusion_stages": (1, 1), "cfg_parallel": True, "pipefusion_patches": 1},
            r"pipefusion_patches=1 is fewer than the 2 pipeline stages \(one per rank per CFG half\)",
        ),
        (
            "pixart",
            2,
            {"pipefusion_stages": (2,)},
            r"pipefusion_stages=\[2\] gives 1 stages, but the pipeline has 2 \(one per rank\)",
        ),
        ("pixart", 2, {"pipefusion_sync": "rows"}, r"pipefusion_sync must be one of 'stages', 'sequence', got 'rows'"),
    ],
)
def test_unsupported_runs_fail_before_any_collective(monkeypatch, family, world, options, message):
    refused_before_any_collective(monkeypatch, family, world, message, strategy="pipefusion", **options)


def test_fused_projections_fail_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe = build_pipeline("pixart")
    pipe.transformer.fuse_qkv_projections()
    with pytest.raises(ParadiffError, match="uses fused QKV projections, which the pipefusion strategy cannot split"):
        paradiff.parallelize(pipe, strategy="pipefusion")
    assert not dist.is_initialized()


def test_options_belong_to_pipefusion():
    with pytest.raises(ParadiffError, match="pipefusion_patches is an option of the pipefusion strategy, not of"):
        paradiff.ParallelConfig(strategy="patch", pipefusion_patches=4)
    with pytest.raises(ParadiffError, match="pipefusion_stages must be None or the number of blocks of each stage"):
        paradiff.ParallelConfig(strategy="pipefusion", pipefusion_stages=(2, 0))
    with pytest.raises(ParadiffError, match="pipefusion_flow must be True or False, got 'no'"):
        paradiff.ParallelConfig(strategy="pipefusion", pipefusion_flow="no")
    assert "pipefusion" in strategy_names() and "'pipefusion'" in supported_combinations()
    assert strategy_class("pipefusion").uses_warmup


def test_patches_default_to_about_twice_the_stages():
    assert plan_patches(32, None, 2, 16) == 4
    assert plan_patches(6, None, 2, 16) == 3  # the divisor nearest to 4
    assert plan_patches(64, None, 4, 16) == 8
    assert plan_patches(5, None, 2, 16) == 5  # a prime row count: one patch per row
    with pytest.raises(ParadiffError, match="height 16 has only 1 rows of 16 pixels; use a height of at least 32"):
        plan_patches(1, None, 2, 16)


def test_balanced_cut():
    assert balanced_cut([1.0] * 4, 2) == (2, 2)
    assert balanced_cut([1.0] * 5, 2) == (2, 3)
    assert balanced_cut([2.0, 2.0, 1.0, 1.0, 1.0, 1.0], 2) == (2, 4)
    assert balanced_cut([1.0, 1.0, 1.0, 9.0], 2) == (3, 1)
    assert balanced_cut([1.0] * 4, 4) == (1, 1, 1, 1)
