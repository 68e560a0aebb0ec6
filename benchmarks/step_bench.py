"""Step parallelism (parastep) and AsyncDiff next to one device and patch parallelism, in one run (CPU, 1 thread/rank).

    python benchmarks/step_bench.py            # ~35M U-Net and ~31M DiT, 512 px, 20 steps, 2 ranks
    python benchmarks/step_bench.py --quick    # a smoke run of the same: 128 px, 4 steps, 1 warm-up step

One device first (this process, 1 thread), then each strategy on N gloo ranks (1 thread each), on the
bench-size pipelines of ``paradiff.tiny`` (SD-style U-Net, 35.0M parameters; PixArt-style DiT, 31.3M)
with the same prompt and seed. Per model and strategy: latency and speedup over one device, bytes sent
per step by the busiest rank, time it spent blocked on communication, the PSNR of the image against
the one-device image and, for parastep and asyncdiff, the ideal speedup T / (W + (T − W) / N), where W counts the
steps every rank runs alike (the first step and ``--warmup`` more). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_common import cached_pipeline, generate
from rank_workers import RankPool

from paradiff.metrics import psnr

QUICK = {"size": 128, "steps": 4, "warmup": 1}


def one_device(family: str, size: int, steps: int) -> dict:
    torch.set_num_threads(1)
    images, latency = generate(cached_pipeline(family), family, size, steps)
    return {"images": images, "latency_s": latency}


def on_ranks(family: str, size: int, steps: int, strategy: str, warmup: int) -> dict:
    import torch.distributed as dist

    import paradiff

    pipe = paradiff.parallelize(cached_pipeline(family), strategy=strategy, warmup_steps=warmup)
    dist.barrier()
    images, latency = generate(pipe, family, size, steps)
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    return {
        "images": images if dist.get_rank() == 0 else None,
        "latency_s": latency,
        "bytes_per_step": stats["bytes_per_step"],
        "wait_s": stats["wait_s"],
    }


def ideal_parastep_speedup(steps: int, warmup: int, ranks: int) -> float:
    """T / (W + (T − W) / N), with W the steps run on every rank alike: the first one and ``warmup`` more."""
    alike = min(steps, warmup + 1)
    return steps / (alike + (steps - alike) / ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="sd,pixart")
    parser.add_argument("--strategies", default="patch,parastep,asyncdiff")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", default="benchmarks/out/step_bench.json")
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)

    rows = []
    with RankPool(args.nproc, timeout_s=3600, threads_per_rank=1) as pool:
        for family in args.models.split(","):
            base = one_device(family, args.size, args.steps)
            for strategy in args.strategies.split(","):
                results = pool.run(on_ranks, family, args.size, args.steps, strategy, args.warmup)
                parallel_s = max(r["latency_s"] for r in results)
                # asyncdiff too: W steps whole on every rank, then 1/N of a step per rank (balanced components)
                divided = strategy in ("parastep", "asyncdiff")
                ideal = ideal_parastep_speedup(args.steps, args.warmup, args.nproc) if divided else None
                rows.append(
                    {
                        "model": family,
                        "strategy": strategy,
                        "size": args.size,
                        "steps": args.steps,
                        "warmup": args.warmup,
                        "nproc": args.nproc,
                        "one_device_s": base["latency_s"],
                        "parallel_s": parallel_s,
                        "speedup": base["latency_s"] / parallel_s,
                        "ideal_speedup": ideal,
                        "bytes_per_step": max(r["bytes_per_step"] for r in results),
                        "wait_s": max(r["wait_s"] for r in results),
                        "psnr_db": psnr(results[0]["images"], base["images"]),
                    }
                )
                print(_table(rows[-1:]), flush=True)
    print("\n" + _table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch_threads_per_rank": 1, "quick": args.quick, "rows": rows}, indent=2))
    print(f"wrote {out}")


def _table(rows: list[dict]) -> str:
    head = (
        "| model | strategy | px | steps | W | ranks | 1 device s | parallel s | speedup | ideal "
        "| MB/step/rank | wait s | PSNR dB |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        ideal = f"{r['ideal_speedup']:.2f}x" if r["ideal_speedup"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['size']} | {r['steps']} | {r['warmup']} | {r['nproc']} | "
            f"{r['one_device_s']:.1f} | {r['parallel_s']:.1f} | {r['speedup']:.2f}x | {ideal} | "
            f"{r['bytes_per_step'] / 1e6:.3f} | {r['wait_s']:.2f} | {r['psnr_db']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
