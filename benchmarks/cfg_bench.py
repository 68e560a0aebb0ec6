"""The CFG split on two-call guidance (Flux true CFG) next to one device, in one run (CPU, 1 thread per rank).

    python benchmarks/cfg_bench.py                 # ~bench-size Flux-style DiT, 256 px, 10 steps, 2 ranks
    python benchmarks/cfg_bench.py --quick         # a smoke run: 64 px, 3 steps

Flux with a negative prompt and ``true_cfg_scale > 1`` calls its transformer twice per step (a "cond" and
an "uncond" call). With ``strategy="cfg"`` each of the two ranks runs one of them, at the same time;
the first step runs both on both ranks. Prints latency, speedup, bytes per step and the largest
difference from the one-device image, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from bench_common import cached_pipeline, generate
from rank_workers import RankPool

from paradiff.tiny import prompt_inputs

QUICK = {"size": 64, "steps": 3}


def true_cfg_call(pipe, size: int, steps: int):
    """``(images, seconds)`` of one true-CFG call (negative prompt, ``true_cfg_scale=2``) with seed 0."""
    negative = prompt_inputs(pipe, "flux", seed=1)
    return generate(
        pipe,
        "flux",
        size,
        steps,
        negative_prompt_embeds=negative["prompt_embeds"],
        negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"],
        true_cfg_scale=2.0,
    )


def one_device(size: int, steps: int) -> dict:
    torch.set_num_threads(1)
    images, latency = true_cfg_call(cached_pipeline("flux"), size, steps)
    return {"images": images, "latency_s": latency}


def on_ranks(size: int, steps: int) -> dict:
    import torch.distributed as dist

    import paradiff

    pipe = paradiff.parallelize(cached_pipeline("flux"), strategy="cfg")
    dist.barrier()
    images, latency = true_cfg_call(pipe, size, steps)
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    return {"images": images, "latency_s": latency, "bytes_per_step": stats["bytes_per_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", default="benchmarks/out/cfg_bench.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps = QUICK["size"], QUICK["steps"]

    with RankPool(2, timeout_s=3600, threads_per_rank=1) as pool:
        base = one_device(args.size, args.steps)
        ranks = pool.run(on_ranks, args.size, args.steps)
    parallel = max(result["latency_s"] for result in ranks)
    row = {
        "model": "flux (bench size), true CFG",
        "px": args.size,
        "steps": args.steps,
        "one_device_s": base["latency_s"],
        "cfg_2_ranks_s": parallel,
        "speedup": base["latency_s"] / parallel,
        "bytes_per_step": ranks[0]["bytes_per_step"],
        "max_abs_difference": float(np.abs(ranks[0]["images"] - base["images"]).max()),
    }
    print("| model | px | steps | 1 device s | cfg, 2 ranks s | speedup | kB/step/rank | max abs difference |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {row['model']} | {row['px']} | {row['steps']} | {row['one_device_s']:.1f} | {row['cfg_2_ranks_s']:.1f} "
        f"| {row['speedup']:.2f}x | {row['bytes_per_step'] / 1e3:.1f} | {row['max_abs_difference']:.1e} |"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
