"""PipeFusion next to one device and the other strategies, side by side in one run (CPU, 1 thread per rank).

    python benchmarks/pipefusion_bench.py            # PixArt-style DiT (31M parameters), 512 px, 20 steps, 2 ranks
    python benchmarks/pipefusion_bench.py --quick    # a smoke run of the same: 128 px, 3 steps

One device first (this process, 1 thread), then each strategy on N gloo ranks (1 thread each), all on
the same bench-size pipeline (``paradiff.tiny``, size "bench") with the same prompt and seed:
diffusers' own Ulysses (``ulysses``), displaced patch parallelism (``patch``), PipeFusion flowing from
call to call (``pipefusion``), the same with its exact calls in row bands on every rank (``pipefusion-rows``,
``pipefusion_sync="sequence"``), draining at every call (``pipefusion-drain``, ``pipefusion_flow=False``),
and the CFG split (``cfg``, 2 ranks only). Per strategy: latency and speedup over one device, bytes
sent per step by the busiest rank, time blocked on communication (busiest rank), peak resident
memory per rank during the call (the largest rank's; Linux VmHWM, reset before the call) and the
denoiser parameters each rank holds, the PSNR of the image against the one-device image, and for
PipeFusion the share of its displaced denoiser calls each rank spent idle waiting for another stage,
rank by rank, next to the drain model's (N−1)/(M+N−1). Prints a table and writes JSON.

The "host ceiling" line is the best speedup this host allows at all: every rank runs the whole one-device job
at the same time, and ``N × one-device time / that time`` is what N perfectly split ranks could reach.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
from pathlib import Path

import torch
from bench_common import cached_pipeline, concurrently, generate
from rank_workers import RankPool

from paradiff.metrics import psnr

QUICK = {"size": 128, "steps": 3}


def _reset_peak_memory() -> None:
    """Linux, glibc: freed heap memory goes back to the system, then the peak resident set restarts from here."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def _peak_memory_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _parameter_mb(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def one_device(family: str, size: int, steps: int) -> dict:
    torch.set_num_threads(1)
    pipe = cached_pipeline(family)
    _reset_peak_memory()
    images, latency = generate(pipe, family, size, steps)
    return {
        "images": images,
        "latency_s": latency,
        "peak_mb": _peak_memory_mb(),
        "params_mb": _parameter_mb(pipe.transformer),
    }


#: Labels of settings that are a strategy with options: the label, the strategy, the options.
VARIANTS = {
    "pipefusion-drain": ("pipefusion", {"pipefusion_flow": False}),
    "pipefusion-rows": ("pipefusion", {"pipefusion_sync": "sequence"}),
}


def on_ranks(family: str, size: int, steps: int, label: str, warmup: int, patches: int | None) -> dict:
    import torch.distributed as dist

    import paradiff

    strategy, options = VARIANTS.get(label, (label, {}))
    if strategy == "pipefusion":
        options = {**options, "pipefusion_patches": patches}
    pipe = paradiff.parallelize(cached_pipeline(family), strategy=strategy, warmup_steps=warmup, **options)
    params_mb = _parameter_mb(pipe.transformer)
    _reset_peak_memory()
    dist.barrier()
    images, latency = generate(pipe, family, size, steps)
    peak_mb = _peak_memory_mb()
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    displaced = [row["idle_share"] for row in stats["per_step"] if "idle_share" in row and row["step"] > warmup]
    return {
        "images": images if dist.get_rank() == 0 else None,
        "latency_s": latency,
        "bytes_per_step": stats["bytes_per_step"],
        "wait_s": stats["wait_s"],
        "idle_share": stats.get("idle_share"),
        "idle_share_displaced": statistics.mean(displaced) if displaced else None,
        "flow": stats.get("flow"),
        "peak_mb": peak_mb,
        "params_mb": params_mb,
    }


def _drain_share(family: str, size: int, nproc: int, patches: int | None) -> tuple[int, float]:
    """Patches per displaced call and the idle share a pipeline that drains every call has: (N−1)/(M+N−1)."""
    from paradiff.models import family_of
    from paradiff.stages.blocks import plan_patches

    model = cached_pipeline(family).transformer
    pixels = family_of(model).pixels_per_row(model, 8)
    count = plan_patches(size // pixels, patches, nproc, pixels)
    return count, (nproc - 1) / (count + nproc - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pixart", help="family of paradiff.tiny, bench size")
    parser.add_argument("--strategies", default="ulysses,patch,pipefusion,pipefusion-drain,cfg")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps of patch and pipefusion")
    parser.add_argument("--patches", type=int, default=None, help="pipefusion_patches (default: the strategy's)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK['size']} px, {QUICK['steps']} steps")
    parser.add_argument("--out", default="benchmarks/out/pipefusion_bench.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps = QUICK["size"], QUICK["steps"]
    strategies = [s for s in args.strategies.split(",") if s != "cfg" or args.nproc == 2]  # cfg alone: 2 ranks

    base = one_device(args.model, args.size, args.steps)
    rows = [_base_row(base)]
    print(_table(rows), flush=True)
    with RankPool(args.nproc, timeout_s=3600, threads_per_rank=1) as pool:
        concurrent = pool.run(concurrently, args.model, args.size, args.steps)
        ceiling = args.nproc * base["latency_s"] / max(concurrent)
        print(f"host ceiling: {ceiling:.2f}x ({args.nproc} one-device jobs side by side: {max(concurrent):.1f} s)")
        for strategy in strategies:
            results = pool.run(on_ranks, args.model, args.size, args.steps, strategy, args.warmup, args.patches)
            rows.append(_row(strategy, base, results, args))
            print(_table(rows[-1:]), flush=True)
    print("\n" + _table(rows) + f"\nhost ceiling: {ceiling:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("model", "size", "steps", "warmup", "patches", "nproc")}
    out.write_text(
        json.dumps({"torch_threads_per_rank": 1, **settings, "host_ceiling": ceiling, "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


def _base_row(base: dict) -> dict:
    empty = {"bytes_per_step": 0.0, "wait_s": 0.0, "psnr_db": None, "patches": None, "drain_model": None}
    return {"strategy": "one device", "ranks": 1, "latency_s": base["latency_s"], "speedup": 1.0,
            "peak_mb": base["peak_mb"], "params_mb": base["params_mb"], "idle_share": None,
            "idle_share_displaced": None, **empty}  # fmt: skip


def _row(strategy: str, base: dict, results: list[dict], args) -> dict:
    latency = max(r["latency_s"] for r in results)
    row = {
        "strategy": strategy,
        "ranks": args.nproc,
        "latency_s": latency,
        "speedup": base["latency_s"] / latency,
        "bytes_per_step": max(r["bytes_per_step"] for r in results),
        "wait_s": max(r["wait_s"] for r in results),
        "peak_mb": max(r["peak_mb"] for r in results),
        "params_mb": max(r["params_mb"] for r in results),
        "psnr_db": psnr(results[0]["images"], base["images"]),
        "idle_share": None,
        "idle_share_displaced": None,
        "patches": None,
        "drain_model": None,
    }
    if strategy.startswith("pipefusion"):
        row["patches"], row["drain_model"] = _drain_share(args.model, args.size, args.nproc, args.patches)
        row["idle_share"] = statistics.mean(r["idle_share"] for r in results)
        row["idle_share_displaced"] = [r["idle_share_displaced"] for r in results]
        row["flow"] = [r["flow"] for r in results]
    return row


def _table(rows: list[dict]) -> str:
    head = (
        "| strategy | ranks | s | speedup | MB/step/rank | wait s | peak MB/rank | params MB/rank | PSNR dB "
        "| idle per rank (displaced) | drain model |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        shares = r["idle_share_displaced"] or []
        idle = " / ".join("" if share is None else f"{100 * share:.0f}%" for share in shares)
        quality = "" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}"
        model = "" if r["drain_model"] is None else f"{100 * r['drain_model']:.0f}% (M={r['patches']})"
        lines.append(
            f"| {r['strategy']} | {r['ranks']} | {r['latency_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['bytes_per_step'] / 1e6:.2f} | {r['wait_s']:.2f} | {r['peak_mb']:.0f} | {r['params_mb']:.1f} | "
            f"{quality} | {idle} | {model} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
