"""Rank 1 runs something other than rank 0: each case changes one thing on rank 1 only (run on every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff import ParadiffError
from paradiff.loading import load_pipeline, prompt_kwargs
from paradiff.tiny import build_pipeline, prompt_inputs

#: case -> (what rank 1 changes at parallelize, in the call). The tiny random pipeline takes embeddings;
#: the built-in one takes a prompt.
CALL_CASES = {
    "prompt": {"prompt": "a blue square"},
    "prompt_embeds": "embeddings",
    "guidance_scale": {"guidance_scale": 5.0},
    "cfg": {"guidance_scale": 1.0},
    "height": {"height": 128},
    "num_inference_steps": {"num_inference_steps": 3},
    "output_type": {"output_type": "pt"},
    "generator": {"generator": None},
}
SETUP_CASES = ("strategy", "warmup_steps", "timeout_s", "weights", "dtype", "model")


def disagree(case: str) -> str:
    """The ParadiffError this rank raised, or "" if none was raised."""
    other = dist.get_rank() == 1
    pipe = load_pipeline("paradiff-tiny") if case == "prompt" else build_pipeline("sd")
    options = {"strategy": "patch", "warmup_steps": 1, "timeout_s": 60.0}
    if other and case in ("strategy", "warmup_steps", "timeout_s"):
        options[case] = {"strategy": "parastep", "warmup_steps": 2, "timeout_s": 61.0}[case]
    if other and case == "weights":
        with torch.no_grad():
            next(pipe.unet.parameters()).view(-1)[0] += 1e-3
    if other and case == "dtype":
        pipe.to(torch.float64)
    if other and case == "model":
        pipe = build_pipeline("pixart")
    try:
        pipe = paradiff.parallelize(pipe, **options)
        inputs = prompt_kwargs(pipe, "paradiff-tiny", "a red circle") if case == "prompt" else prompt_inputs(pipe, "sd")
        call = {**inputs, "height": 64, "width": 64, "num_inference_steps": 2, "output_type": "np"}
        call["generator"] = torch.Generator().manual_seed(0)
        change = CALL_CASES.get(case, {})
        if change == "embeddings":
            change = {"prompt_embeds": inputs["prompt_embeds"] + 1}
        if other:
            call.update(change)
        pipe(**call)
    except ParadiffError as error:
        return str(error)
    finally:
        paradiff.unparallelize(pipe)
    return ""
