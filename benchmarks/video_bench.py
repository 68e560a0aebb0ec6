"""Every strategy on a Wan-style video DiT next to one device, in one run (CPU, 1 thread per rank).

    python benchmarks/video_bench.py             # ~30M-parameter Wan DiT, 17 frames at 256 px, 20 steps, 2 ranks
    python benchmarks/video_bench.py --quick     # a smoke run: 5 frames at 64 px, 3 steps

The pipeline is diffusers' ``WanPipeline`` (two transformer calls per step for CFG) with a random
``WanTransformer3DModel`` of 7 blocks, width 512 (8 heads of 64), feed-forward 2048: 17 frames at
256 px are 5 latent frames of 32 × 32, i.e. 5 × 16 × 16 = 1280 tokens per call. Timed: the denoising
loop (``output_type="latent"``); the video VAE is the tiny one of the tests. ``ulysses`` is diffusers'
own Ulysses attention (``enable_parallelism`` with the class's ``_cp_plan``), which paradiff only sets
up. Prints latency, speedup over one device, bytes per step, the call's working memory per rank (how far
the resident set grew above its size at the call's start: activations and exchange buffers, not weights) and
PSNR of the latents against one device (peak: the one-device latents' range), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench_common  # noqa: F401  (puts tests/ on the import path)
import numpy as np
import torch
from bench_common import status_mb
from family_pipelines_video import build_video_pipeline
from rank_workers import RankPool

from paradiff.metrics import psnr

QUICK = {"size": 64, "frames": 5, "steps": 3}
#: The benchmark's transformer (about 30M parameters); the rest of the tiny test pipeline is kept.
WAN_30M = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=7, rope_max_seq_len=1024)
#: The strategies run, each with its options; the first three steps exact (the displaced ones' warm-up).
STRATEGIES = {
    "patch": {"warmup_steps": 2},
    "pipefusion": {"warmup_steps": 2},
    "asyncdiff": {"warmup_steps": 2},
    "parastep": {"warmup_steps": 2},
    "cfg": {},
    "ulysses": {},
}

_PIPE: dict = {}


def pipeline():
    """The benchmark's pipeline, built once per process (the same weights in every process) and run once untimed."""
    if "pipe" not in _PIPE:
        pipe, call = build_video_pipeline("wan")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pipe.transformer = type(pipe.transformer).from_config({**pipe.transformer.config, **WAN_30M}).eval()
        _PIPE["pipe"], _PIPE["call"] = pipe, call
        video(pipe, QUICK["size"], QUICK["frames"], 1)  # first-call allocations out of the timed runs
    return _PIPE["pipe"]


def video(pipe, size: int, frames: int, steps: int) -> tuple[np.ndarray, float]:
    """``(latents, seconds)`` of one call at seed 0."""
    call = {**_PIPE["call"], "height": size, "width": size, "num_frames": frames, "num_inference_steps": steps}
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe(**{**call, "generator": torch.Generator().manual_seed(0)}).frames
    return np.asarray(latents, dtype=np.float32), time.perf_counter() - start


def timed_with_memory(pipe, size: int, frames: int, steps: int) -> dict:
    """One call's latents and seconds, and how much the resident set grew at its peak over the call's start (MB).

    The growth is the call's working memory (activations, exchange buffers), comparable between the one-device
    process and the ranks, which hold different leftovers of earlier runs (Linux: ``/proc/self/clear_refs``).
    """
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current resident set
    before = status_mb("VmRSS")
    latents, latency = video(pipe, size, frames, steps)
    return {"latents": latents, "latency_s": latency, "working_mb": status_mb("VmHWM") - before}


def one_device(size: int, frames: int, steps: int) -> dict:
    torch.set_num_threads(1)
    return timed_with_memory(pipeline(), size, frames, steps)


def on_ranks(strategy: str, options: dict, size: int, frames: int, steps: int) -> dict:
    import torch.distributed as dist

    import paradiff

    pipe = paradiff.parallelize(pipeline(), strategy=strategy, **options)
    dist.barrier()
    result = timed_with_memory(pipe, size, frames, steps)
    stats = paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    return {**result, "bytes_per_step": stats["bytes_per_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", default="benchmarks/out/video_bench.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.frames, args.steps = QUICK["size"], QUICK["frames"], QUICK["steps"]
    shape = (args.size, args.frames, args.steps)

    rows = []
    base = one_device(*shape)
    params = sum(p.numel() for p in pipeline().transformer.parameters())
    latent_range = float(base["latents"].max() - base["latents"].min())
    for strategy in args.strategies.split(","):
        with RankPool(2, timeout_s=7200, threads_per_rank=1) as pool:  # fresh processes: their memory untouched
            ranks = pool.run(on_ranks, strategy, STRATEGIES[strategy], *shape)
        latency = max(result["latency_s"] for result in ranks)
        rows.append(
            {
                "strategy": strategy,
                "latency_s": latency,
                "speedup": base["latency_s"] / latency,
                "bytes_per_step": ranks[0]["bytes_per_step"],
                "working_mb_per_rank": max(result["working_mb"] for result in ranks),
                "psnr_db": psnr(ranks[0]["latents"], base["latents"], data_range=latent_range),
            }
        )
    best_ulysses = next((row["latency_s"] for row in rows if row["strategy"] == "ulysses"), None)
    print(
        f"Wan-style DiT, {params / 1e6:.1f}M parameters, {args.frames} frames at {args.size} px, {args.steps} steps, "
        f"2 ranks; one device: {base['latency_s']:.1f} s, working memory {base['working_mb']:.0f} MB"
    )
    print("| strategy | latency s | speedup | vs diffusers Ulysses | kB/step/rank | working MB/rank | PSNR dB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        versus = f"{best_ulysses / row['latency_s']:.2f}x" if best_ulysses else "—"
        print(
            f"| {row['strategy']} | {row['latency_s']:.1f} | {row['speedup']:.2f}x | {versus} "
            f"| {row['bytes_per_step'] / 1e3:.0f} | {row['working_mb_per_rank']:.0f} | {row['psnr_db']:.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"shape": dict(zip(("size", "frames", "steps"), shape, strict=True)), "parameters": params}
    Path(args.out).write_text(json.dumps({**result, "one_device_s": base["latency_s"], "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
