"""A call whose setting would not fit in one rank's device memory is refused before its denoiser runs, naming the
settings that fit; ``patch``'s narrower stale K/V shrinks what a rank keeps and stays exact during warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exactness import TOLERANCE, latents, relative_error

import paradiff
from paradiff.errors import ParadiffError
from paradiff.plan.costs import predict
from paradiff.plan.hardware import PROFILES
from paradiff.plan.workload import pipeline_workload
from paradiff.tiny import build_pipeline, prompt_inputs

SIZE, STEPS = 64, 4


def call_inputs(pipe) -> dict:
    return {
        **prompt_inputs(pipe, "pixart"),
        "height": SIZE,
        "width": SIZE,
        "num_inference_steps": STEPS,
        "output_type": "latent",
        "generator": torch.Generator().manual_seed(0),
    }


def predicted_mb(strategy: str, **options) -> float:
    """The plan's memory per rank of ``strategy`` on 2 ranks for this test's call, in MB."""
    pipe = build_pipeline("pixart")
    workload, _ = pipeline_workload(pipe, lambda: pipe(**call_inputs(pipe)))
    return predict(workload, PROFILES["l40-pcie"], "float32", strategy, 2, STEPS, 1, **options).memory_mb


def refused_or_run(device_memory) -> dict:
    """On every rank: ``patch`` at ``device_memory``; its refusal or its latents, and how often a block ran."""
    pipe = build_pipeline("pixart")
    blocks_run = []
    pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: blocks_run.append(1))
    pipe = paradiff.parallelize(pipe, strategy="patch", warmup_steps=1, device_memory=device_memory)
    try:
        return {"refusal": None, "latents": latents(pipe(**call_inputs(pipe))), "blocks_run": len(blocks_run)}
    except ParadiffError as error:
        return {"refusal": str(error), "blocks_run": len(blocks_run)}
    finally:
        paradiff.unparallelize(pipe)


@pytest.mark.timeout(240)
def test_a_setting_that_cannot_fit_is_refused_before_the_denoiser_runs_naming_what_fits(pool2):
    patch, pipefusion = predicted_mb("patch"), predicted_mb("pipefusion")
    assert pipefusion < patch
    between = (patch + pipefusion) / 2 / 1024  # GiB
    for result in pool2.run(refused_or_run, between, timeout_s=200):
        assert result["refusal"] is not None
        assert "patch needs about" in result["refusal"] and "per rank" in result["refusal"]
        assert "fits:" in result["refusal"] and "pipefusion" in result["refusal"].split("fits:")[1]
        assert result["blocks_run"] == 0
    for result in pool2.run(refused_or_run, "l40-pcie", timeout_s=200):  # a profile's 48 GB: it fits and runs
        assert result["refusal"] is None and result["blocks_run"] > 0


@pytest.mark.parametrize("device_memory", [-1, 0, True, [4]])
def test_device_memory_must_be_gib_or_a_profile(device_memory):
    with pytest.raises(ParadiffError, match="device_memory must be None, a positive number of GiB or a hardware"):
        paradiff.ParallelConfig(strategy="patch", device_memory=device_memory)


def test_the_plan_counts_a_narrower_stale_buffer():
    assert predicted_mb("patch", stale_dtype="bfloat16") < predicted_mb("patch")


def stale_dtype_run(stale_dtype: str | None, warmup: int) -> dict:
    """``patch`` with ``stale_dtype`` at ``warmup``: its latents and their error against one device, the bytes sent
    per step, and the bytes of the stale K/V buffers this rank keeps."""
    pipe = build_pipeline("pixart")
    reference = latents(pipe(**call_inputs(pipe)))
    pipe = paradiff.parallelize(  # every layer's pieces sent on their own (none in the small pieces' bucket)
        pipe, strategy="patch", warmup_steps=warmup, stale_dtype=stale_dtype, bucket_limit_bytes=0
    )
    try:
        output = latents(pipe(**call_inputs(pipe)))
        exchanges = pipe._paradiff.strategy_part.comm.state.buffers  # kept until the next call begins
        kept = sum(
            t.numel() * t.element_size()
            for (name, *_), exchange in exchanges.items()
            if name.endswith((".k", ".v"))
            for buffers in (exchange.latest, exchange.spare)
            if buffers is not None
            for t in buffers
        )
        sent = paradiff.comm_stats(pipe)["bytes_per_step"]
    finally:
        paradiff.unparallelize(pipe)
    return {"output": output, "error": relative_error(output, reference), "kept": kept, "sent": sent}


@pytest.mark.timeout(240)
def test_a_narrower_stale_buffer_halves_what_a_rank_keeps_and_warmup_stays_exact(pool2):
    full = pool2.run(stale_dtype_run, None, 1, timeout_s=200)
    narrow = pool2.run(stale_dtype_run, "bfloat16", 1, timeout_s=200)
    exact = pool2.run(stale_dtype_run, "bfloat16", STEPS, timeout_s=200)
    for wide, small in zip(full, narrow, strict=True):
        assert small["kept"] <= 0.5 * wide["kept"], (small["kept"], wide["kept"])
        assert small["sent"] < wide["sent"]
        assert not np.array_equal(small["output"], wide["output"])  # the displaced steps read the rounded K/V
        assert small["error"] < 2 * wide["error"] + 1e-5, (small["error"], wide["error"])
    for result in exact:
        assert result["error"] <= TOLERANCE, result["error"]


def test_stale_dtype_must_be_a_narrower_float():
    with pytest.raises(ParadiffError, match="stale_dtype must be None or one of 'bfloat16', 'float16'"):
        paradiff.ParallelConfig(strategy="patch", stale_dtype="int8")
