"""DualParal (`dualparal`): a diffusion-forcing video's frame blocks flowing through layer stages on the ranks."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

import paradiff
from paradiff import ParadiffError
from paradiff.config import ParallelConfig
from paradiff.metrics import psnr
from paradiff.models import family_of
from paradiff.pipeline import ParallelState
from paradiff.runtime.staleness import StalenessGuard
from paradiff.strategies.dualparal import one_device_schedule
from paradiff.tiny import build, pipeline
from paradiff.tiny.forcing import BLOCK, df_call, latent_frames_to_frames

#: Largest difference allowed against the one-device schedule, relative to the output's largest magnitude (fp32).
TOLERANCE = 1e-5
#: A long video in two windows of the stock pipeline: 8 latent frames, windows of 6 overlapping by 2 (one block).
LONG_VIDEO = dict(base_num_frames=latent_frames_to_frames(6), overlap_history=5)


def _resident_block_parameters(model) -> int:
    return sum(p.numel() for block in model.blocks for p in block.parameters())


def dualparal_vs_one_device(layers: int = 4, context: int | None = None, extra: dict | None = None, **options):
    """The one-device schedule, then ``dualparal`` twice on this rank; what each rank held, the tokens a block saw."""
    extra = extra or {}
    pipe = pipeline("skyreels-df", layers=layers)
    model = pipe.transformer
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    widest = []
    handle = model.blocks[0].register_forward_pre_hook(lambda _, args: widest.append(args[0].shape[1]))
    with one_device_schedule(pipe, context):
        reference = pipe(**df_call(**extra)).frames
    whole_window = max(widest)
    widest.clear()
    before = _resident_block_parameters(model)
    pipe = paradiff.parallelize(pipe, strategy="dualparal", dualparal_context=context, **options)
    try:
        first = pipe(**df_call(**extra)).frames
        second = pipe(**df_call(**extra)).frames
        held = _resident_block_parameters(model)
    finally:
        paradiff.unparallelize(pipe)
        handle.remove()
    return {
        "reference": reference.numpy(),
        "first": first.numpy(),
        "second": second.numpy(),
        "blocks_before": before,
        "blocks_held": held,
        "largest_block": sum(p.numel() for p in model.blocks[0].parameters()),
        "weights_restored": all(torch.equal(p, weights[name]) for name, p in model.named_parameters()),
        "tokens_whole_window": whole_window,
        "tokens_per_pass": max(widest),
    }


def _check_exact(results) -> None:
    reference = results[0]["reference"]
    scale = float(np.abs(reference).max())
    for result in results:
        assert np.abs(result["first"] - reference).max() <= TOLERANCE * scale
        assert np.array_equal(result["first"], results[0]["first"])  # every rank returns the same video
        assert np.array_equal(result["second"], result["first"])  # nothing of the first call leaks into the second
        assert result["weights_restored"]


def window_allows(frames: int, block: int, context: int | None) -> torch.Tensor:
    """``[query frame, key frame]``: whether a query frame sees a key frame in dualparal's window, as documented:
    its own frame block and the last ``context`` frames (None: all) of the block before."""
    allowed = torch.zeros(frames, frames, dtype=torch.bool)
    for query in range(frames):
        own = query // block
        for key in range(frames):
            before = key // block == own - 1 and key >= own * block - (context or block)
            allowed[query, key] = key // block == own or before
    return allowed


def windowed_stock_pipeline(context: int | None = None, extra: dict | None = None) -> np.ndarray:
    """The stock pipeline in this one process, each transformer block given dualparal's window as its attention
    mask in place of the model's block-causal one: a reference that shares no code with ``dualparal``."""
    pipe = pipeline("skyreels-df", layers=4)
    model = pipe.transformer
    frames_and_tokens = []

    def shape(_, args, kwargs):  # the call's latent frames and patches per frame
        _, _, frames, height, width = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape
        frames_per_patch, rows, columns = model.config.patch_size
        frames_and_tokens[:] = [frames // frames_per_patch, (height // rows) * (width // columns)]

    def narrow(_, args):  # block(hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask)
        assert args[4] is not None, "the model's self-attention is not block-causal in this call"
        frames, tokens = frames_and_tokens
        allowed = window_allows(frames, model.config.num_frame_per_block, context)
        mask = allowed.repeat_interleave(tokens, 0).repeat_interleave(tokens, 1)
        assert mask.shape == args[4].shape[-2:]
        return (*args[:4], mask[None, None])

    handles = [model.register_forward_pre_hook(shape, with_kwargs=True)]
    handles += [block.register_forward_pre_hook(narrow) for block in model.blocks]
    try:
        return pipe(**df_call(**(extra or {}))).frames.numpy()
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("context", "extra"), [(None, None), (1, None), (None, LONG_VIDEO)], ids=["whole-block", "one-frame", "two-windows"]
)
def test_fresh_equals_the_one_device_schedule_at_2_ranks(pool2, context, extra):
    """Against the one-device schedule, and both against the stock pipeline with the window as its mask (a bug
    the first two share would pass the first check alone)."""
    results = pool2.run(dualparal_vs_one_device, context=context, extra=extra, dualparal_displaced=False)
    _check_exact(results)
    independent = windowed_stock_pipeline(context, extra)
    scale = float(np.abs(independent).max())
    assert np.abs(results[0]["reference"] - independent).max() <= TOLERANCE * scale  # one_device_schedule
    for result in results:
        assert np.abs(result["first"] - independent).max() <= TOLERANCE * scale  # dualparal, every rank


@pytest.mark.timeout(120)
def test_fresh_equals_the_one_device_schedule_at_4_ranks(pool4):
    _check_exact(pool4.run(dualparal_vs_one_device, dualparal_displaced=False))


@pytest.mark.timeout(120)
def test_cfg_split_times_dualparal_is_exact_at_4_ranks(pool4):
    _check_exact(pool4.run(dualparal_vs_one_device, layers=2, dualparal_displaced=False, cfg_parallel=True))


@pytest.mark.timeout(120)
def test_each_rank_holds_its_stage_and_one_frame_block(pool2):
    """4 blocks on 2 ranks: each rank keeps 2 blocks' weights, and no block ever sees more than one frame block."""
    results = pool2.run(dualparal_vs_one_device, dualparal_displaced=False)
    for result in results:
        assert result["blocks_held"] <= result["blocks_before"] / 2
        assert result["tokens_per_pass"] * 4 == result["tokens_whole_window"]  # 2 of the video's 8 latent frames
    assert sum(r["blocks_held"] for r in results) == results[0]["blocks_before"]


@pytest.mark.timeout(120)
def test_displaced_reads_last_steps_keys_after_warm_up(pool2):
    displaced = pool2.run(dualparal_vs_one_device, warmup_steps=1)
    reference, first = displaced[0]["reference"], displaced[0]["first"]
    scale = float(np.abs(reference).max())
    assert np.abs(first - reference).max() > TOLERANCE * scale  # the feature cache is one step old
    assert psnr(first, reference, data_range=float(reference.max() - reference.min())) > 20
    assert all(np.array_equal(r["first"], first) and np.array_equal(r["second"], first) for r in displaced)
    # a warm-up as long as the loop (4 blocks of 3 steps, one level apart: 6 iterations) is exact
    _check_exact(pool2.run(dualparal_vs_one_device, warmup_steps=6))


def refreshed_vs_one_device(refreshed: frozenset[int], **options) -> dict:
    """:func:`dualparal_vs_one_device` under ``fidelity_floor_db`` with the staleness guard refreshing ``refreshed``
    (its decision fixed: what is tested is how a refreshed call runs)."""
    threshold = mock.patch.object(ParallelState, "threshold", return_value=0.0)  # as if calibrated before
    decide = mock.patch.object(StalenessGuard, "decide", lambda guard, step: step in refreshed)
    with threshold, decide:
        return dualparal_vs_one_device(fidelity_floor_db=30.0, warmup_steps=0, **options)


@pytest.mark.timeout(120)
def test_refreshed_calls_read_this_steps_keys(pool2):
    """Every call refreshed (warm-up 0): exact, as a warm-up over the whole loop; some refreshed: between the two."""
    _check_exact(pool2.run(refreshed_vs_one_device, frozenset(range(1, 6))))
    some = pool2.run(refreshed_vs_one_device, frozenset({1, 3}))
    none = pool2.run(refreshed_vs_one_device, frozenset({1}))
    reference = some[0]["reference"]
    error = {name: float(np.abs(r[0]["first"] - reference).max()) for name, r in (("some", some), ("none", none))}
    assert TOLERANCE * float(np.abs(reference).max()) < error["some"] < error["none"], error
    assert all(np.array_equal(r["first"], some[0]["first"]) for r in some)


def cfg_alone_vs_stock() -> dict:
    """The CFG split alone on this pipeline (per-frame timesteps) against the stock pipeline on one device."""
    pipe = pipeline("skyreels-df", layers=2)
    stock = pipe(**df_call()).frames
    pipe = paradiff.parallelize(pipe, strategy="cfg")
    try:
        return {"reference": stock.numpy(), "first": pipe(**df_call()).frames.numpy(), "weights_restored": True}
    finally:
        paradiff.unparallelize(pipe)


@pytest.mark.timeout(120)
def test_the_cfg_split_pairs_calls_with_per_frame_timesteps(pool2):
    results = pool2.run(cfg_alone_vs_stock)
    for result in results:
        result["second"] = result["first"]
    _check_exact(results)


def call_error(options: dict, strategy: str = "dualparal", **call) -> str:
    """The ParadiffError a ``strategy`` call raises on this rank, or ''."""
    pipe = paradiff.parallelize(pipeline("skyreels-df", layers=2), strategy=strategy, **options)
    try:
        pipe(**df_call(**call))
    except ParadiffError as error:
        return str(error)
    finally:
        paradiff.unparallelize(pipe)
    return ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "call", "message"),
    [
        (
            {},
            {"latent_frames": 7},
            r"cuts the 7 latent frames into blocks of causal_block_size=2, which does not divide them; use "
            r"num_frames=21 or 29",
        ),
        ({"dualparal_context": 3}, {}, r"dualparal_context=3 frames is more than a frame block \(causal_block_size=2"),
        ({}, {"causal_block_size": None}, r"attends over all frames at once; pass causal_block_size > 1"),
    ],
)
def test_calls_it_cannot_run_fail_on_every_rank(pool2, options, call, message):
    import re

    for error in pool2.run(call_error, options, **call):
        assert re.search(message, error), error


@pytest.mark.timeout(120)
def test_parastep_refuses_a_pipeline_that_copies_its_scheduler(pool2):
    """Diffusion forcing steps one scheduler copy per frame block, out of the step rounds' sight."""
    for error in pool2.run(call_error, {}, strategy="parastep"):
        assert "this pipeline copies its scheduler during the call" in error and "'dualparal' or 'cfg'" in error


@pytest.mark.parametrize("family", ["wan", "latte"])
def test_a_pipeline_without_per_frame_noise_levels_is_refused(monkeypatch, family):
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipe, _ = build(family)
    with pytest.raises(ParadiffError, match=r"one noise level per frame.*SkyReelsV2DiffusionForcingPipeline"):
        paradiff.parallelize(pipe, strategy="dualparal")
    assert not hasattr(pipe, "_paradiff") and not dist.is_initialized()


def test_more_ranks_than_blocks_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ParadiffError, match=r"4 stages \(one per rank\) .* this SkyReelsV2Transformer3DModel has 2"):
        paradiff.parallelize(pipeline("skyreels-df", layers=2), strategy="dualparal")
    assert not dist.is_initialized()


def test_a_model_that_patches_frames_together_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ParadiffError, match=r"this SkyReelsV2Transformer3DModel patches 2 frames into one token"):
        paradiff.parallelize(pipeline("skyreels-df", layers=2, patch_size=(2, 2, 2)), strategy="dualparal")
    assert not dist.is_initialized()


def test_options_are_validated():
    with pytest.raises(ParadiffError, match="dualparal_context must be None or a number of latent frames >= 1"):
        ParallelConfig("dualparal", dualparal_context=0)
    with pytest.raises(ParadiffError, match="dualparal_displaced must be True or False"):
        ParallelConfig("dualparal", dualparal_displaced="yes")


def test_the_rotary_table_at_an_offset_is_the_stock_tables_rows():
    model = pipeline("skyreels-df", layers=2).transformer
    latent = torch.zeros(1, 16, 6, 4, 4)
    whole = model.rope(latent)
    tokens = 4  # rows × columns of patches per frame
    for first in (0, 2, 4):
        block = family_of(model).rotary_at(model.rope, latent[:, :, first : first + BLOCK], first)
        for table, mine in zip(whole, block, strict=True):
            assert torch.equal(table[:, first * tokens : (first + BLOCK) * tokens], mine)


def test_the_one_device_schedule_is_the_stock_pipeline_for_two_blocks():
    pipe = pipeline("skyreels-df", layers=2)
    stock = pipe(**df_call(latent_frames=4)).frames
    with one_device_schedule(pipe):
        assert torch.equal(pipe(**df_call(latent_frames=4)).frames, stock)
    assert not torch.equal(pipe(**df_call()).frames, _one_device(pipe))  # from three blocks on, the window narrows


def _one_device(pipe):
    with one_device_schedule(pipe):
        return pipe(**df_call()).frames
