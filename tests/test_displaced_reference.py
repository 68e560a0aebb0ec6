"""Displaced steps equal their single-process references (``displaced_reference``) up to float round-off.

PSNR floors alone would let an off-by-one in staleness pass (reading the activations of two steps ago,
or this step's): these tests pin the displaced semantics of each strategy, on the final latents in fp32.
"""

from __future__ import annotations

from functools import partial
from unittest import mock

import numpy as np
import pytest
import torch
from displaced_reference import (
    asyncdiff_reference,
    parastep_reference,
    patch_reference,
    pipefusion_flowing_reference,
    pipefusion_reference,
)
from patch_cases import flux_true_cfg_inputs

import paradiff
from paradiff.pipeline import ParallelState
from paradiff.runtime.staleness import StalenessGuard
from paradiff.tiny import build_pipeline, prompt_inputs

STEPS = 5
#: Largest difference allowed, relative to the output's largest magnitude: float round-off.
TOLERANCE = 1e-5
#: The displaced output must differ from the one-device output by far more than the tolerance.
DISPLACED_AT_LEAST = 1e-3
#: ``bucket_limit_bytes`` of the patch strategy's two transfer paths: every displaced piece packed into one bucket
#: per call, or each sent on its own (double-buffered).
BUCKET_LIMITS = {"bucketed": 1 << 40, "direct": 0}


def _call(pipe, family: str, size: int, steps: int) -> dict:
    """The call's arguments; ``family`` "flux-true-cfg" runs Flux's CFG as two denoiser calls per step."""
    prompt = flux_true_cfg_inputs(pipe) if family == "flux-true-cfg" else prompt_inputs(pipe, family)
    return {
        **prompt,
        "height": size,
        "width": size,
        "num_inference_steps": steps,
        "generator": torch.Generator().manual_seed(0),
        "output_type": "latent",
    }


def _pipeline(family: str, scheduler: str | None, blocks: int | None = None):
    """PixArt's default DPM-Solver lets the random tiny model's latents grow to hundreds, which buries the
    displaced effect under the output's magnitude; DDIM (which clips its x0 estimate) keeps them bounded.

    ``blocks``: a DiT of that many blocks instead of the tiny one's two (seeded alike on every rank).
    """
    family = family.removesuffix("-true-cfg")
    pipe = build_pipeline(family, scheduler=scheduler or ("ddim" if family == "pixart" else None))
    if blocks is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pipe.transformer = type(pipe.transformer).from_config({**pipe.transformer.config, "num_layers": blocks})
    return pipe


def displaced_latents(
    family: str, size: int, steps: int, scheduler: str | None = None, blocks: int | None = None, **options
) -> np.ndarray:
    """This rank's final latents from ``parallelize(pipe, **options)`` (runs on every rank of a pool)."""
    pipe = paradiff.parallelize(_pipeline(family, scheduler, blocks), **options)
    try:
        return pipe(**_call(pipe, family, size, steps)).images.numpy()
    finally:
        paradiff.unparallelize(pipe)


def _check(
    results: list[np.ndarray], family: str, size: int, steps: int, reference, scheduler=None, blocks=None
) -> None:
    """Every rank equal, equal to ``reference(pipe, call)`` within round-off, and unlike one device."""
    for result in results[1:]:
        np.testing.assert_array_equal(result, results[0])
    pipe = _pipeline(family, scheduler, blocks)
    one_device = pipe(**_call(pipe, family, size, steps)).images.numpy()
    expected = reference(pipe, _call(pipe, family, size, steps)).images.numpy()
    scale = float(np.abs(expected).max())
    error = float(np.abs(results[0] - expected).max()) / scale
    moved = float(np.abs(results[0] - one_device).max()) / scale
    print(f"relative difference to the reference {error:.2e}, to one device {moved:.2e}")
    assert error <= TOLERANCE, error
    assert moved >= DISPLACED_AT_LEAST, moved


@pytest.mark.parametrize(
    ("family", "ranks", "warmup", "size", "transfers"),
    [
        ("sd", 2, 1, 64, "bucketed"),
        ("sd", 4, 2, 128, "direct"),
        ("pixart", 2, 2, 64, "direct"),
        ("pixart", 4, 1, 128, "bucketed"),
    ],
)
def test_patch(rank_pool, family, ranks, warmup, size, transfers):
    limit = BUCKET_LIMITS[transfers]
    results = rank_pool(ranks).run(
        displaced_latents, family, size, STEPS, strategy="patch", warmup_steps=warmup, bucket_limit_bytes=limit
    )
    _check(results, family, size, STEPS, partial(patch_reference, ranks=ranks, warmup_steps=warmup))


@pytest.mark.parametrize(("ranks", "warmup", "patches", "blocks"), [(2, 1, 4, None), (2, 2, 2, None), (4, 1, 4, 4)])
def test_pipefusion(rank_pool, ranks, warmup, patches, blocks):
    """One stage per rank: the tiny PixArt's two blocks serve 2 ranks, a 4-block one 4 ranks; the pipeline drains."""
    options = {"strategy": "pipefusion", "warmup_steps": warmup, "pipefusion_patches": patches}
    results = rank_pool(ranks).run(
        displaced_latents, "pixart", 64, STEPS, blocks=blocks, pipefusion_flow=False, **options
    )
    reference = partial(pipefusion_reference, patches=patches, warmup_steps=warmup)
    _check(results, "pixart", 64, STEPS, reference, blocks=blocks)


def flowing_and_draining(family: str, scheduler: str | None, size: int, steps: int, blocks: int | None, **options):
    """This rank's final latents with the pipeline flowing and draining, and the flowing run's ``flow`` counters."""
    pipe = paradiff.parallelize(_pipeline(family, scheduler, blocks), strategy="pipefusion", **options)
    try:
        flowing = pipe(**_call(pipe, family, size, steps)).images.numpy()
        flow = paradiff.comm_stats(pipe)["flow"]
    finally:
        paradiff.unparallelize(pipe)
    pipe = paradiff.parallelize(pipe, strategy="pipefusion", pipefusion_flow=False, **options)
    try:
        draining = pipe(**_call(pipe, family, size, steps)).images.numpy()
    finally:
        paradiff.unparallelize(pipe)
    return {"flowing": flowing, "draining": draining, "flow": flow}


#: Schedulers under which the tiny PixArt's displaced steps barely move its (large) latents.
MULTISTEP_LIKE = ("dpm", "unipc", "euler")
#: What the flowing reference reproduces of each pipeline's loop: its guidance scale, denoiser calls per step and
#: whether its scheduler scales the model input.
FORMS = {
    "pixart": {"guidance": 4.5},
    "sd3": {"guidance": 7.0},
    "flux-true-cfg": {"guidance": 2.0, "calls": 2},
}


@pytest.mark.parametrize(
    ("family", "scheduler", "ranks", "warmup", "patches", "blocks"),
    [
        ("pixart", "ddim", 4, 1, 4, 4),
        ("pixart", "dpm", 2, 1, 4, None),
        ("pixart", "unipc", 2, 1, 4, None),
        ("pixart", "euler", 2, 1, 2, None),
        ("sd3", None, 2, 1, 4, None),
        ("flux-true-cfg", None, 2, 1, 2, None),
    ],
)
def test_pipefusion_flowing(rank_pool, family, scheduler, ranks, warmup, patches, blocks):
    """Flowing: every displaced call but the last starts the next one's first patches; the ranks equal the flowing
    reference, which equals the draining one bit for bit, and so do the ranks' flowing and draining runs.

    Every scheduler the tiny pipelines use (DDIM, DPM-Solver++, UniPC, Euler, flow matching), CFG batched and as two
    calls per step (Flux's true CFG, in ``cache_context("cond"/"uncond")``). Under DPM-Solver, UniPC and Euler the
    random tiny PixArt's latents grow to hundreds, so the displaced steps move them by less than a millionth of
    their magnitude, below what a comparison within round-off tells apart: there the ranks' flowing and draining
    runs, equal bit for bit, with every call flowing, pin the flow (DDIM and flow matching pin the semantics against
    the reference; two calls per step against it on Wan, in ``test_families``). The reference completes the keys
    ``to_k`` makes, which in Flux's single-stream blocks hold the prompt's tokens too: Flux is not compared with it."""
    options = {"warmup_steps": warmup, "pipefusion_patches": patches}
    results = rank_pool(ranks).run(flowing_and_draining, family, scheduler, 64, STEPS, blocks, **options)
    forms = {**FORMS[family], "scaled": scheduler == "euler"}
    calls = forms.get("calls", 1)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result["flowing"], result["draining"])
        flowed = calls * (STEPS - warmup - 1) - 1  # every displaced call but the last flows into the next
        assert result["flow"] == {
            "calls_flowing": flowed,
            "patches_ahead": flowed * (ranks - 1 - rank),
            "stopped": None,
        }
    pipe = _pipeline(family, scheduler, blocks)
    call = _call(pipe, family, 64, STEPS)
    draining = pipefusion_reference(pipe, call, patches, warmup, calls=calls).images.numpy()
    flowing = pipefusion_flowing_reference(pipe, _call(pipe, family, 64, STEPS), patches, warmup, ranks, **forms)
    np.testing.assert_array_equal(flowing.images.numpy(), draining)
    if scheduler not in MULTISTEP_LIKE and family != "flux-true-cfg":  # the reference completes to_k: not Flux's
        reference = partial(pipefusion_flowing_reference, patches=patches, warmup_steps=warmup, stages=ranks, **forms)
        _check([r["flowing"] for r in results], family, 64, STEPS, reference, scheduler, blocks)


@pytest.mark.parametrize(
    ("family", "scheduler", "ranks", "warmup", "steps"),
    # multistep schedulers keep a history of predictions; 4 ranks, warm-up 2, 6 steps: a round shorter than the ranks
    [("sd", "dpm", 2, 1, STEPS), ("sd", "unipc", 4, 1, 6), ("pixart", None, 2, 2, STEPS), ("pixart", None, 4, 2, 6)],
)
def test_parastep(rank_pool, family, scheduler, ranks, warmup, steps):
    results = rank_pool(ranks).run(
        displaced_latents, family, 64, steps, scheduler, strategy="parastep", warmup_steps=warmup
    )
    _check(results, family, 64, steps, partial(parastep_reference, ranks=ranks, warmup_steps=warmup), scheduler)


@pytest.mark.parametrize(
    ("family", "ranks", "warmup", "cut", "stride"),
    [
        ("sd", 2, 1, (3, 4), 1),
        ("sd", 4, 2, (2, 2, 1, 2), 1),
        ("pixart", 2, 2, (1, 1), 1),
        ("sd", 4, 1, (2, 3, 2), 2),
    ],
)
def test_asyncdiff(rank_pool, family, ranks, warmup, cut, stride):
    results = rank_pool(ranks).run(
        displaced_latents,
        family,
        64,
        STEPS,
        strategy="asyncdiff",
        warmup_steps=warmup,
        asyncdiff_cut=cut,
        asyncdiff_stride=stride,
    )
    reference = partial(asyncdiff_reference, cut=cut, warmup_steps=warmup, stride=stride)
    _check(results, family, 64, STEPS, reference)


#: The steps the staleness guard refreshes in :func:`test_refreshed_steps`: a displaced step on either side of one.
REFRESHED = frozenset({1, 3})
#: ``parastep``'s guard decides only where a round would start: on 2 ranks after step 1, steps 2 and 4.
REFRESHED_ROUNDS = frozenset({1, 4})


def refreshed_latents(family: str, size: int, steps: int, refreshed: frozenset[int], **options) -> np.ndarray:
    """This rank's final latents under ``fidelity_floor_db`` with the guard refreshing ``refreshed`` (its decision is
    fixed: what is tested is how each strategy runs a refreshed step, not which steps the guard picks)."""
    threshold = mock.patch.object(ParallelState, "threshold", return_value=0.0)  # as if calibrated before
    decide = mock.patch.object(StalenessGuard, "decide", lambda guard, step: step in refreshed)
    with threshold, decide:
        return displaced_latents(family, size, steps, fidelity_floor_db=30.0, **options)


@pytest.mark.parametrize(
    ("strategy", "options", "refreshed", "reference"),
    [
        ("patch", {"bucket_limit_bytes": BUCKET_LIMITS["bucketed"]}, REFRESHED, partial(patch_reference, ranks=2)),
        ("patch", {"bucket_limit_bytes": BUCKET_LIMITS["direct"]}, REFRESHED, partial(patch_reference, ranks=2)),
        ("pipefusion", {"pipefusion_patches": 2}, REFRESHED, partial(pipefusion_reference, patches=2)),
        ("asyncdiff", {}, REFRESHED, partial(asyncdiff_reference, cut=(1, 1))),
        ("parastep", {}, REFRESHED_ROUNDS, partial(parastep_reference, ranks=2)),
    ],
    ids=["patch-bucketed", "patch-direct", "pipefusion", "asyncdiff", "parastep"],
)
def test_refreshed_steps(pool2, strategy, options, refreshed, reference):
    """A step the staleness guard refreshes runs exact and is what the next displaced step reads (warm-up 0): equal
    to the reference with those steps exact."""
    results = pool2.run(refreshed_latents, "pixart", 64, STEPS, refreshed, strategy=strategy, warmup_steps=0, **options)
    _check(results, "pixart", 64, STEPS, partial(reference, warmup_steps=0, refreshed=refreshed))
