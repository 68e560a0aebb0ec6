"""diffusers' step caches under every strategy at 2 gloo ranks: exact against the cached one-device run, or refused.

:data:`CASES` is the composition table's part for step caches: one row per (feature, strategy) with what it must
give, ``"exact"`` (fp32 latents within round-off of the same cache on one device, every rank equal) or
``"refused: <words the refusal names>"``. :data:`SETUPS` says how each feature is built: a tiny pipeline, the cache
(by its ``paradiff.caches.presets`` name, with settings that make it skip at 4 steps) and the guidance. Refusals that
``parallelize`` makes come from ``check_parallelize`` alone (before any collective, the same on every rank), so they
are asked of it in this process; the ranks run the exact cases and the refusals made during a call.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from exactness import assert_exact, latents, relative_error
from patch_cases import flux_true_cfg_inputs

import paradiff
from paradiff.caches.presets import apply_cache, reset_cache
from paradiff.errors import ParadiffError
from paradiff.tiny import build_pipeline, prompt_inputs

STEPS = 4
SIZE = 64
#: Every timestep lies in this range (the default ranges leave the first and last steps out).
ALL_TIMESTEPS = [-1, 1001]


@dataclass(frozen=True)
class Setup:
    """A tiny pipeline with a cache: ``family``'s builder, ``cache`` with ``settings``, two-call CFG (``true_cfg``)
    or batched CFG (otherwise, where the family has CFG), ``batch`` images per prompt."""

    family: str
    cache: str
    settings: dict = field(default_factory=dict)
    true_cfg: bool = False
    batch: int = 1


SETUPS = {
    "FirstBlockCache": Setup("flux", "first-block", {"threshold": 0.3}, true_cfg=True),
    # one device skips the second step (0.309 < 0.32), each image alone would not agree (0.333 and 0.287)
    "FirstBlockCache, 2 images per prompt": Setup("flux", "first-block", {"threshold": 0.32}, batch=2),
    "TaylorSeerCache": Setup(
        "flux",
        "taylorseer",
        {"cache_interval": 2, "disable_cache_before_step": 1, "taylor_factors_dtype": "float32"},
        true_cfg=True,
    ),
    "PyramidAttentionBroadcast": Setup("pixart", "pyramid", {"spatial_attention_timestep_skip_range": ALL_TIMESTEPS}),
    "PyramidAttentionBroadcast, two-call CFG": Setup(
        "flux", "pyramid", {"spatial_attention_timestep_skip_range": ALL_TIMESTEPS}, true_cfg=True
    ),
    "FasterCache": Setup(
        "pixart",
        "faster",
        {
            "spatial_attention_timestep_skip_range": ALL_TIMESTEPS,
            "unconditional_batch_skip_range": 2,
            "unconditional_batch_timestep_skip_range": ALL_TIMESTEPS,
        },
    ),
    "MagCache": Setup(
        "flux",
        "mag",
        {"threshold": 0.5, "retention_ratio": 0.25, "mag_ratios": [1.0, 1.05, 1.02, 1.01]},
        true_cfg=True,
    ),
    "MagCache calibration": Setup("flux", "mag", {"calibrate": True}, true_cfg=True),
}

BLOCKS_APART = "refused: needs all of a call's blocks on one rank"
COUNTS_CALLS = "refused: counts each layer's calls as steps"

#: (feature, strategy, expected): the rows of the composition table for step caches.
CASES = [
    ("FirstBlockCache", "patch", "exact"),
    ("FirstBlockCache", "cfg", "exact"),
    ("FirstBlockCache", "ulysses", "exact"),
    ("FirstBlockCache", "parastep", "exact"),
    ("FirstBlockCache", "asyncdiff", BLOCKS_APART),
    ("FirstBlockCache", "pipefusion", BLOCKS_APART),
    ("FirstBlockCache, 2 images per prompt", "cfg", "exact"),
    ("TaylorSeerCache", "patch", "exact"),
    ("TaylorSeerCache", "cfg", "exact"),
    ("TaylorSeerCache", "ulysses", "exact"),
    ("TaylorSeerCache", "parastep", "exact"),
    ("TaylorSeerCache", "asyncdiff", "exact"),
    ("TaylorSeerCache", "pipefusion", COUNTS_CALLS),
    ("PyramidAttentionBroadcast", "patch", "exact"),
    ("PyramidAttentionBroadcast", "cfg", "exact"),
    ("PyramidAttentionBroadcast", "ulysses", "exact"),
    ("PyramidAttentionBroadcast", "parastep", "exact"),
    ("PyramidAttentionBroadcast", "asyncdiff", "exact"),
    ("PyramidAttentionBroadcast", "pipefusion", COUNTS_CALLS),
    ("PyramidAttentionBroadcast, two-call CFG", "patch", "exact"),
    ("PyramidAttentionBroadcast, two-call CFG", "cfg", "refused: two-call guidance"),
    ("FasterCache", "patch", "exact"),
    ("FasterCache", "cfg", "refused: needs both halves on one rank"),
    ("FasterCache", "ulysses", "exact"),
    ("FasterCache", "parastep", "exact"),
    ("FasterCache", "asyncdiff", "refused: leaves the unconditional half out of the batch"),
    ("FasterCache", "pipefusion", COUNTS_CALLS),
    ("MagCache", "patch", "exact"),
    ("MagCache", "cfg", "exact"),
    ("MagCache", "ulysses", "exact"),
    ("MagCache", "parastep", "exact"),
    ("MagCache", "asyncdiff", BLOCKS_APART),
    ("MagCache", "pipefusion", BLOCKS_APART),
    ("MagCache calibration", "patch", "refused: calibrates"),
]
#: Refusals made during the first call (two-call guidance shows only then); the others come from parallelize.
REFUSED_IN_CALL = {("PyramidAttentionBroadcast, two-call CFG", "cfg")}
#: Where each rank holds part of every call, so FirstBlockCache's measure is summed over the ranks.
SHARED_MEASURE = {
    ("FirstBlockCache", "patch"),
    ("FirstBlockCache", "ulysses"),
    ("FirstBlockCache, 2 images per prompt", "cfg"),
}


def _case_id(case) -> str:
    return f"{case[0]}-{case[1]}".replace(", ", "-").replace(" ", "-")


def cached_pipeline(feature: str):
    """The feature's tiny pipeline with its cache applied, and the call's arguments."""
    setup = SETUPS[feature]
    pipe = build_pipeline(setup.family)
    inputs = flux_true_cfg_inputs(pipe) if setup.true_cfg else prompt_inputs(pipe, setup.family, batch_size=setup.batch)
    apply_cache(pipe, setup.cache, STEPS, setup.settings)
    return pipe, inputs


def generate(pipe, inputs: dict) -> np.ndarray:
    """The call's final latents; the cache's state is reset after it (PixArt's pipeline does not reset it)."""
    call = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS, "output_type": "latent"}
    output = latents(pipe(**inputs, **call, generator=torch.Generator().manual_seed(0)))
    reset_cache(pipe)
    return output


def cached_vs_one_device(feature: str, strategy: str, warmup: int = STEPS, **options) -> dict:
    """On this rank: the cached one-device latents, then under ``parallelize`` (every step exact unless ``warmup``
    says fewer; ``options`` for it), then restored."""
    pipe, inputs = cached_pipeline(feature)
    reference = generate(pipe, inputs)
    pipe = paradiff.parallelize(pipe, strategy=strategy, warmup_steps=warmup, timeout_s=60, **options)
    try:
        parallel = generate(pipe, inputs)
        stats = paradiff.comm_stats(pipe)
    finally:
        paradiff.unparallelize(pipe)
    restored = generate(pipe, inputs)
    return {
        "error": relative_error(parallel, reference),
        "output": parallel,
        "restored_error": relative_error(restored, reference),
        "measure_agreements": stats["measure_agreements"],
    }


def refusal_in_call(feature: str, strategy: str) -> str:
    """The error this rank's first parallel call raises."""
    pipe, inputs = cached_pipeline(feature)
    pipe = paradiff.parallelize(pipe, strategy=strategy, warmup_steps=STEPS, timeout_s=60)
    try:
        generate(pipe, inputs)
    except ParadiffError as error:
        return str(error)
    finally:
        paradiff.unparallelize(pipe)
    return "no error"


@pytest.mark.parametrize("case", [case for case in CASES if case[2] == "exact"], ids=_case_id)
def test_exact_under_the_strategy(pool2, case):
    feature, strategy, _ = case
    results = pool2.run(cached_vs_one_device, feature, strategy, timeout_s=300)
    assert_exact(results, case)
    for result in results:
        assert result["restored_error"] == 0.0, "unparallelize leaves the cache working as before"
        assert (result["measure_agreements"] > 0) == ((feature, strategy) in SHARED_MEASURE), result
    if feature == "FirstBlockCache" and strategy == "patch":
        assert results[0]["measure_agreements"] == 2 * (STEPS - 1)  # both calls of every step after the first


def test_the_measure_is_summed_over_the_token_cut_and_the_cfg_halves_at_4_ranks(pool4):
    """patch within each CFG half, 2 x 2 ranks: each rank holds a quarter of a call (half its tokens, one image)."""
    feature = "FirstBlockCache, 2 images per prompt"
    results = pool4.run(cached_vs_one_device, feature, "patch", cfg_parallel=True, timeout_s=600)
    assert_exact(results)
    assert all(result["measure_agreements"] > 0 for result in results)


@pytest.mark.parametrize(
    ("feature", "strategy"),
    [("FirstBlockCache", "patch"), ("FirstBlockCache", "parastep"), ("TaylorSeerCache", "asyncdiff")],
)
def test_displaced_runs_stay_close_and_every_rank_equal(pool2, feature, strategy):
    """After one warm-up step a rank may skip a layer at its first displaced call and run it later (patch then
    sends its piece on its own), or see only some steps (parastep, asyncdiff): displaced, never crashed or split."""
    results = pool2.run(cached_vs_one_device, feature, strategy, 1, timeout_s=300)
    for result in results:
        assert 0 < result["error"] < 0.1, result["error"]
    np.testing.assert_array_equal(results[0]["output"], results[1]["output"])


@pytest.mark.parametrize("case", [case for case in CASES if case[2].startswith("refused")], ids=_case_id)
def test_refused_naming_cache_and_strategy(pool2, case):
    feature, strategy, expected = case
    reason = expected.removeprefix("refused: ")
    if (feature, strategy) in REFUSED_IN_CALL:
        messages = pool2.run(refusal_in_call, feature, strategy, timeout_s=300)
        assert messages[0] == messages[1], "every rank refuses alike, at the same call"
    else:
        pipe, _ = cached_pipeline(feature)
        with pytest.raises(ParadiffError) as refusal:
            paradiff.check_parallelize(pipe, strategy=strategy, world_size=2)
        messages = [str(refusal.value)]
    name = feature.split(",")[0].split(" ")[0]
    assert name in messages[0] and reason in messages[0], messages[0]
    assert f"strategy='{strategy}'" in messages[0] or "CFG split" in messages[0], messages[0]


def refusal_at_parallelize(feature: str, strategy: str) -> str:
    pipe, _ = cached_pipeline(feature)
    try:
        paradiff.parallelize(pipe, strategy=strategy, timeout_s=60)
    except ParadiffError as error:
        return str(error)
    paradiff.unparallelize(pipe)
    return "no error"


def test_parallelize_refuses_on_every_rank_before_any_collective(pool2):
    messages = pool2.run(refusal_at_parallelize, "FirstBlockCache", "asyncdiff", timeout_s=300)
    assert messages[0] == messages[1] and "FirstBlockCache cannot run under strategy='asyncdiff'" in messages[0]


@pytest.mark.parametrize("feature", [name for name in SETUPS if name != "MagCache calibration"])
def test_each_cache_changes_the_one_device_result(feature):
    """Else 'exact' would hold for a cache that never skips anything."""
    pipe, inputs = cached_pipeline(feature)
    cached = generate(pipe, inputs)
    bare = build_pipeline(SETUPS[feature].family)
    assert relative_error(cached, generate(bare, inputs)) > 1e-4  # 10 times what "exact" allows


class CountingHook(ModelHook):
    """A stateful hook paradiff does not know."""

    _is_stateful = True

    def reset_state(self, module):
        return module


def test_auto_is_refused_with_a_cache_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe, _ = cached_pipeline("MagCache")
    with pytest.raises(ParadiffError, match="strategy='auto' plans by timing .* MagCache .*strategy='patch'"):
        paradiff.parallelize(pipe, strategy="auto")
    assert not hasattr(pipe, "_paradiff") and not dist.is_initialized()


def test_an_unknown_stateful_hook_is_refused():
    pipe = build_pipeline("flux")
    HookRegistry.check_if_exists_or_initialize(pipe.transformer.transformer_blocks[0]).register_hook(
        CountingHook(), "counting"
    )
    with pytest.raises(
        ParadiffError, match="CountingHook cannot run under strategy='patch'.*'counting' on transformer_blocks.0"
    ):
        paradiff.check_parallelize(pipe, strategy="patch", world_size=2)


def cache_on_rank_0_only() -> str:
    pipe, _ = cached_pipeline("MagCache") if dist.get_rank() == 0 else (build_pipeline("flux"), None)
    try:
        paradiff.parallelize(pipe, strategy="patch", timeout_s=60)
    except ParadiffError as error:
        return str(error)
    paradiff.unparallelize(pipe)
    return "no error"


def test_ranks_with_different_caches_fail_at_parallelize(pool2):
    messages = pool2.run(cache_on_rank_0_only, timeout_s=300)
    assert (
        messages[0] == messages[1]
        and "step caches differs: MagCache on 2 modules (rank 0), none (rank 1)" in messages[0]
    )


# paradiff bench --cache


def bench_job(tmp_path, *argv: str):
    from paradiff import cli
    from paradiff.cli.bench_options import job_from_args

    bench = ["bench", "--model", "paradiff-tiny-dit", "--size", "64", "--steps", "3", "--prompts", "1"]
    return job_from_args(cli.build_parser().parse_args([*bench, "--out", str(tmp_path), *argv]), threads=1)


def test_bench_runs_each_cache_on_one_device_and_under_each_strategy(pool2, tmp_path):
    from paradiff.bench.run import bench_on_rank

    pyramid = 'pyramid:{"spatial_attention_timestep_skip_range": [-1, 1001]}'
    job = bench_job(tmp_path, "--strategies", "cfg", "--cache", pyramid)
    results = pool2.run(bench_on_rank, job, timeout_s=300)[0]
    labels = [run.spec.label for run in results.runs]
    assert labels == ["one device", "cfg", "pyramid cache, one device", "pyramid cache, cfg"]
    bare, _, cached, cached_cfg = (run.outputs[0] for run in results.runs)
    assert np.abs(cached - bare).max() > 1e-3, "the cache changed the image"
    assert np.abs(cached_cfg - cached).max() < 1e-4, "under cfg the cached image is the cached one-device image"
    command = shlex.split(job.command())
    assert command[command.index("--cache") + 1] == pyramid, "the report's command reruns the cache"


def test_bench_refuses_a_cache_a_strategy_cannot_run_before_any_image(pool2, tmp_path):
    from rank_workers import RankFailure

    from paradiff.bench.run import bench_on_rank

    with pytest.raises(RankFailure) as failure:
        pool2.run(bench_on_rank, bench_job(tmp_path, "--strategies", "cfg", "--cache", "faster"), timeout_s=300)
    for traceback in failure.value.failures.values():
        assert "in _check_caches" in traceback and "FasterCache cannot run under strategy='cfg'" in traceback


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        ("nope", "unknown cache 'nope'; available: first-block, taylorseer, pyramid, faster, mag"),
        ("first-block:{threshold", "the settings of cache 'first-block' are not JSON"),
        ("mag:[1, 2]", "the settings of cache 'mag' must be a JSON object"),
    ],
)
def test_bench_refuses_an_unknown_cache_or_bad_settings_before_any_worker(
    capsys, monkeypatch, tmp_path, cache, message
):
    from paradiff import cli

    monkeypatch.setattr(cli, "run_on_ranks", lambda *args, **kwargs: pytest.fail("workers were started"))
    assert cli.main(["bench", "--model", "paradiff-tiny-dit", "--out", str(tmp_path), "--cache", cache]) == 2
    assert message in capsys.readouterr().err


def test_a_cache_needing_named_calls_is_refused_on_a_denoiser_without_them():
    pipe = build_pipeline("pixart")
    with pytest.raises(ParadiffError, match="'first-block' keeps its state per named denoiser call"):
        apply_cache(pipe, "first-block", STEPS)


# docs/caches.md's table is these cases.

DOC = Path(__file__).resolve().parents[1] / "docs" / "caches.md"


def cases_table() -> str:
    """:data:`CASES` as a Markdown table: one row per feature, one column per strategy."""
    strategies = list(dict.fromkeys(strategy for _, strategy, _ in CASES))
    features = list(dict.fromkeys(feature for feature, _, _ in CASES))
    cells = {(feature, strategy): expected for feature, strategy, expected in CASES}
    lines = [f"| cache (pipeline) | {' | '.join(f'`{s}`' for s in strategies)} |", "|---" * (len(strategies) + 1) + "|"]
    for feature in features:
        setup = SETUPS[feature]
        guidance = "two-call CFG" if setup.true_cfg else ("batched CFG" if setup.family != "flux" else "no CFG")
        label = f"{feature.split(',')[0]} ({setup.family}, {guidance}{', 2 images' if setup.batch == 2 else ''})"
        row = [cells.get((feature, strategy), "—") for strategy in strategies]
        lines.append(f"| {label} | {' | '.join(row)} |")
    return "\n".join(lines)


def test_the_docs_table_is_the_tested_cases():
    assert cases_table() in DOC.read_text(), f"paste into {DOC}:\n{cases_table()}"
