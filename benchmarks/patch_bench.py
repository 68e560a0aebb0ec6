"""Displaced patch parallelism vs one device, side by side in one run (CPU, 1 thread per rank).

    python benchmarks/patch_bench.py --models sd,pixart --size 512 --steps 20 --nproc 2

For each model: the one-device latency (this process, 1 thread), then the same call on N gloo ranks
(1 thread each), the speedup, bytes moved per step per rank, time blocked on communication, and the
PSNR of the parallel image against the one-device image. Prints a table and writes JSON.

This machine's speed drifts by tens of percent within minutes, so with ``--repeats R`` the one-device
and parallel runs alternate R times and the table reports medians (the JSON keeps every run).

The "host ceiling" column is the best speedup this host allows at all: every rank runs the whole
one-device job at the same time, and ``N × one-device time / that time`` is what N perfectly split
ranks could reach. (On a 2-vCPU cloud machine two busy cores each run ~20% slower than one.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_common import cached_pipeline, concurrently, generate
from rank_workers import RankPool

from paradiff.metrics import psnr


def one_device(family: str, size: int, steps: int) -> dict:
    torch.set_num_threads(1)
    images, latency = generate(cached_pipeline(family), family, size, steps)
    return {"images": images, "latency_s": latency}


def on_ranks(family: str, size: int, steps: int, warmup: int, partial_context) -> dict:
    import torch.distributed as dist

    import paradiff

    pipe = paradiff.parallelize(cached_pipeline(family), warmup_steps=warmup, partial_context=partial_context)
    dist.barrier()
    images, latency = generate(pipe, family, size, steps)
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    stats.pop("per_step")
    return {"images": images if dist.get_rank() == 0 else None, "latency_s": latency, **stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="sd,pixart")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--partial-context", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="alternate one-device and parallel runs R times")
    parser.add_argument("--out", default="benchmarks/out/patch_bench.json")
    args = parser.parse_args()

    rows = []
    with RankPool(args.nproc, timeout_s=3600, threads_per_rank=1) as pool:
        for family in args.models.split(","):
            runs = []
            concurrent_s = []
            for _ in range(args.repeats):
                base = one_device(family, args.size, args.steps)
                results = pool.run(on_ranks, family, args.size, args.steps, args.warmup, args.partial_context)
                runs.append((base, results))
                concurrent_s.append(max(pool.run(concurrently, family, args.size, args.steps)))
            one_device_s = [base["latency_s"] for base, _ in runs]
            parallel_s = [max(r["latency_s"] for r in results) for _, results in runs]
            base, results = runs[-1]
            par = results[0]
            rows.append(
                {
                    "model": family,
                    "size": args.size,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "nproc": args.nproc,
                    "partial_context": args.partial_context,
                    "one_device_s": statistics.median(one_device_s),
                    "parallel_s": statistics.median(parallel_s),
                    "speedup": statistics.median(one_device_s) / statistics.median(parallel_s),
                    "host_ceiling": args.nproc * statistics.median(one_device_s) / statistics.median(concurrent_s),
                    "one_device_runs_s": one_device_s,
                    "all_ranks_one_device_runs_s": concurrent_s,
                    "parallel_runs_s": parallel_s,
                    "bytes_per_step": par["bytes_per_step"],
                    "wait_s": max(r["wait_s"] for r in results),
                    "vae_decode_bytes": par.get("vae_decode_bytes", 0),
                    "psnr_db": psnr(par["images"], base["images"]),
                }
            )
            print(_table(rows[-1:]), flush=True)
    print("\n" + _table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch_threads_per_rank": 1, "rows": rows}, indent=2))
    print(f"wrote {out}")


def _table(rows: list[dict]) -> str:
    head = (
        "| model | px | steps | W | ranks | 1 device s | parallel s | speedup | host ceiling "
        "| MB/step/rank | wait s | PSNR dB |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['size']} | {r['steps']} | {r['warmup']} | {r['nproc']} | {r['one_device_s']:.1f} | "
            f"{r['parallel_s']:.1f} | {r['speedup']:.2f}x | {r['host_ceiling']:.2f}x | "
            f"{r['bytes_per_step'] / 1e6:.2f} | {r['wait_s']:.2f} | "
            f"{r['psnr_db']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
