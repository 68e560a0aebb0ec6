"""Every strategy on a Wan-style video DiT next to one device, and long videos, in one run (CPU, 1 thread per rank).

    python benchmarks/video_bench.py             # both tables below
    python benchmarks/video_bench.py --quick     # smoke run: 5 frames at 64 px, 3 steps; long videos from 4 frames
    python benchmarks/video_bench.py --only long # the long-video table alone

The pipeline is diffusers' ``WanPipeline`` (two transformer calls per step for CFG) with a random
``WanTransformer3DModel`` of 7 blocks, width 512 (8 heads of 64), feed-forward 2048: 17 frames at
256 px are 5 latent frames of 32 × 32, i.e. 5 × 16 × 16 = 1280 tokens per call. Timed: the denoising
loop (``output_type="latent"``); the video VAE is the tiny one of the tests. ``ulysses`` is diffusers'
own Ulysses attention (``enable_parallelism`` with the class's ``_cp_plan``), which paradiff only sets
up; ``patch-bf16`` is ``patch`` keeping the other bands' stale K/V in bf16 (``stale_dtype``). Prints latency,
speedup over one device, bytes per step, the call's working memory per rank (how far the resident set grew above
its size at the call's start: activations and exchange buffers, not weights) and PSNR of the latents against one
device (peak: the one-device latents' range), and writes JSON.

Long videos (``--only long``): diffusers' ``SkyReelsV2DiffusionForcingPipeline`` with a random
``SkyReelsV2Transformer3DModel`` of the same size (7 blocks, width 512, feed-forward 2048; ~32M parameters),
its asynchronous schedule (``causal_block_size=2`` latent frames, ``ar_step=1``, CFG), at 1×, 2× and 4× the
latent frames one pass holds (``--long-frames``, 8 by default: the whole video in one window, as one device
runs it), and 4× in the pipeline's windows of 2× (``base_num_frames``, each window starting with the previous
one's last frame block: ``overlap_history=5``). One device (a fresh process) against ``dualparal`` (fresh and
displaced), ``patch`` and ``parastep`` on 2 ranks: latency, the resident high-water mark per rank during the
call (weights included) and its growth over the call's start (working memory), PSNR of the latents against one
device, and flicker, the mean absolute change of the latents from one frame to the next (the one device's in
the first row of each length). A strategy that refuses the pipeline or fails on it gets a row saying why.
Beside each ``dualparal`` row, the speedup ``paradiff plan`` predicts for it, timed on the same 2 ranks just
before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import bench_common  # noqa: F401  (puts tests/ on the import path)
import numpy as np
import torch
from bench_common import status_mb
from rank_workers import RankFailure, RankPool

from paradiff import tiny
from paradiff.metrics import frame_changes, psnr
from paradiff.tiny.forcing import df_call, latent_frames_to_frames

QUICK = {"size": 64, "frames": 5, "steps": 3}
#: The benchmark's transformer (about 30M parameters); the rest of the tiny test pipeline is kept.
WAN_30M = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=7, rope_max_seq_len=1024)
#: The rows: strategy and options; the first three steps exact (the displaced ones' warm-up).
STRATEGIES = {
    "patch": ("patch", {"warmup_steps": 2}),
    "patch-bf16": ("patch", {"warmup_steps": 2, "stale_dtype": "bfloat16"}),
    "pipefusion": ("pipefusion", {"warmup_steps": 2}),
    "asyncdiff": ("asyncdiff", {"warmup_steps": 2}),
    "parastep": ("parastep", {"warmup_steps": 2}),
    "cfg": ("cfg", {}),
    "ulysses": ("ulysses", {}),
}

#: The long-video table's transformer (the same size) and call: latent frames of one pass, steps, pixels.
SKYREELS_30M = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, rope_max_seq_len=1024)
LONG = {"frames": 8, "steps": 6, "size": 128}
QUICK_LONG = {"frames": 4, "steps": 2, "size": 32}
#: The long-video lengths, in frames of one pass, and the window of each (None: the whole video in one).
LONG_CASES = ((1, None), (2, None), (4, None), (4, 2))
#: The long-video rows: strategy and options.
LONG_STRATEGIES = {
    "dualparal (fresh)": ("dualparal", {"dualparal_displaced": False}),
    "dualparal (displaced)": ("dualparal", {"warmup_steps": 2}),
    "patch": ("patch", {"warmup_steps": 2}),
    "parastep": ("parastep", {"warmup_steps": 2}),
}

_PIPE: dict = {}


def pipeline():
    """The benchmark's pipeline, built once per process (the same weights in every process) and run once untimed."""
    if "pipe" not in _PIPE:
        pipe, call = tiny.build("wan")
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


def long_video(
    strategy: str | None, options: dict, latent_frames: int, steps: int, size: int, windows: dict | None = None
) -> dict:
    """One long-video call on this rank, with its memory; or why it failed.

    ``strategy`` None: one device, the stock pipeline; ``"schedule"``: one device under ``one_device_schedule``.
    ``windows``: the call's ``base_num_frames`` and ``overlap_history`` (None: the whole video in one window).
    """
    import paradiff
    from paradiff.strategies.dualparal import one_device_schedule

    torch.set_num_threads(1)
    pipe = tiny.pipeline("skyreels-df", layers=7, **SKYREELS_30M)
    call = df_call(latent_frames=latent_frames, size=size, steps=steps, **(windows or {}))
    with torch.no_grad():
        pipe(**df_call(latent_frames=2, size=size, steps=1))  # first-call allocations out of the timed run
    window = one_device_schedule(pipe) if strategy == "schedule" else contextlib.nullcontext()
    try:
        if strategy not in (None, "schedule"):
            pipe = paradiff.parallelize(pipe, strategy=strategy, **options)
        Path("/proc/self/clear_refs").write_text("5")
        before = status_mb("VmRSS")
        start = time.perf_counter()
        with torch.no_grad(), window:
            latents = pipe(**call).frames
        latency = time.perf_counter() - start
    except paradiff.ParadiffError as error:
        return {"failed": f"refused: {error}"}
    except Exception as error:  # a strategy that accepts the pipeline but breaks on it: the row says so
        return {"failed": f"fails: {type(error).__name__}: {error}"}
    finally:
        paradiff.unparallelize(pipe)
    return {
        "latents": latents.numpy(),
        "latency_s": latency,
        "peak_mb": status_mb("VmHWM"),
        "working_mb": status_mb("VmHWM") - before,
        "parameters": sum(p.numel() for p in pipe.transformer.parameters()),
    }


def long_video_plan(latent_frames: int, steps: int, size: int, windows: dict | None = None) -> dict | None:
    """``paradiff plan``'s predicted speedups of the ``dualparal`` rows (timed on these ranks); rank 0 returns them."""
    from paradiff.plan.job import PlanJob
    from paradiff.plan.on_ranks import plan_pipeline

    torch.set_num_threads(1)
    pipe = tiny.pipeline("skyreels-df", layers=7, **SKYREELS_30M)

    def call(height: int, call_steps: int, output_type: str):
        call = df_call(latent_frames=latent_frames, size=height, steps=call_steps, **(windows or {}))
        return pipe(**call)  # latents, as timed

    fresh_warmup = 10**6  # past the loop's end: fresh at every iteration
    job = PlanJob("skyreels-df", nproc=2, steps=steps, strategies=("dualparal",), warmups=(2, fresh_warmup))
    with torch.no_grad():
        plan = plan_pipeline(pipe, call, size, job, torch.device("cpu"))
    if plan is None:
        return None
    warmups = {row.warmup_steps: row.predicted_speedup for row in plan.predictions}
    return {"dualparal (fresh)": warmups[fresh_warmup], "dualparal (displaced)": warmups[2]}


def flicker(latents: np.ndarray) -> float:
    """Mean absolute change of ``(1, channels, frames, rows, cols)`` latents from one frame to the next."""
    return float(frame_changes(np.moveaxis(latents[0], 1, 0)).mean())


def _long_row(common: dict, label: str, ranks: list[dict], base: dict, schedule: dict) -> dict:
    if "failed" in ranks[0]:
        return {**common, "strategy": label, "failed": ranks[0]["failed"]}
    latents, latency = ranks[0]["latents"], max(result["latency_s"] for result in ranks)

    def against(reference: dict) -> float:
        return psnr(latents, reference["latents"], data_range=float(np.ptp(reference["latents"])))

    return {
        **common,
        "strategy": label,
        "latency_s": latency,
        "speedup": base["latency_s"] / latency,
        "peak_mb_per_rank": max(r["peak_mb"] for r in ranks),
        "working_mb_per_rank": max(r["working_mb"] for r in ranks),
        "psnr_db": against(base),
        "psnr_schedule_db": against(schedule),
        "flicker": flicker(latents),
    }


def long_video_table(one_pass: int, steps: int, size: int, out: str) -> None:
    """One device against each long-video row at each of ``LONG_CASES``; prints and writes JSON.

    Two references: one device running the stock pipeline, and one device under ``one_device_schedule`` (what
    ``dualparal`` computes fresh: the model's block-causal window narrowed to the previous block's frames).
    """
    rows = []
    for multiple, window in LONG_CASES:
        shape = (one_pass * multiple, steps, size)
        windows = None if window is None else {"base_num_frames": latent_frames_to_frames(one_pass * window)}
        if windows is not None:
            windows["overlap_history"] = 5  # 2 latent frames: the last frame block of a window starts the next
        with RankPool(1, timeout_s=7200, threads_per_rank=1) as pool:  # fresh processes: their memory untouched
            base = pool.run(long_video, None, {}, *shape, windows)[0]
        with RankPool(1, timeout_s=7200, threads_per_rank=1) as pool:
            schedule = pool.run(long_video, "schedule", {}, *shape, windows)[0]
        with RankPool(2, timeout_s=7200, threads_per_rank=1) as pool:
            predicted = pool.run(long_video_plan, *shape, windows)[0]
        label = f"{multiple}×" if window is None else f"{multiple}×, windows of {one_pass * window}"
        common = {"latent_frames": shape[0], "multiple": label}
        rows.append(_long_row(common, "one device", [base], base, schedule))
        rows.append(_long_row(common, "one-device schedule", [schedule], base, schedule))
        for label, (strategy, options) in LONG_STRATEGIES.items():
            with RankPool(2, timeout_s=7200, threads_per_rank=1) as pool:
                try:
                    ranks = pool.run(long_video, strategy, options, *shape, windows)
                except RankFailure as failure:
                    ranks = [{"failed": f"fails: {str(failure).splitlines()[0]}"}]
            rows.append({**_long_row(common, label, ranks, base, schedule), "predicted_speedup": predicted.get(label)})
    print(
        f"Long videos: SkyReels-V2 diffusion-forcing DiT, {base['parameters'] / 1e6:.1f}M parameters, {size} px, "
        f"{steps} steps, blocks of 2 latent frames one level apart, CFG; one pass holds {one_pass} latent frames; "
        "2 ranks; PSNR of the latents against one device (stock) and against the one-device schedule"
    )
    print(
        "| latent frames | strategy | latency s | speedup | predicted | peak MB/rank | working MB/rank | PSNR dB | "
        "PSNR vs schedule dB | flicker |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def decibels(value) -> str:
        return "—" if value is None else "∞" if value == float("inf") else f"{value:.1f}"

    for row in rows:
        frames = f"{row['latent_frames']} ({row['multiple']})"
        if "failed" in row:
            print(f"| {frames} | {row['strategy']} | {row['failed'].splitlines()[0][:160]} | | | | | | | |")
            continue
        predicted = "—" if row.get("predicted_speedup") is None else f"{row['predicted_speedup']:.2f}x"
        print(
            f"| {frames} | {row['strategy']} | {row['latency_s']:.1f} | {row['speedup']:.2f}x | {predicted} "
            f"| {row['peak_mb_per_rank']:.0f} | {row['working_mb_per_rank']:.0f} | {decibels(row['psnr_db'])} "
            f"| {decibels(row['psnr_schedule_db'])} | {row['flicker']:.4f} |"
        )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    shape = {"one_pass_latent_frames": one_pass, "steps": steps, "size": size}
    Path(out).write_text(json.dumps({"shape": shape, "parameters": base["parameters"], "rows": rows}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}, long videos {QUICK_LONG}")
    parser.add_argument("--only", choices=("strategies", "long"), help="run one table (default: both)")
    parser.add_argument("--long-frames", type=int, default=LONG["frames"], help="latent frames one pass holds")
    parser.add_argument("--long-steps", type=int, default=LONG["steps"])
    parser.add_argument("--long-size", type=int, default=LONG["size"])
    parser.add_argument("--out", default="benchmarks/out/video_bench.json")
    parser.add_argument("--long-out", default="benchmarks/out/video_long_bench.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.frames, args.steps = QUICK["size"], QUICK["frames"], QUICK["steps"]
        args.long_frames, args.long_steps, args.long_size = (
            QUICK_LONG["frames"],
            QUICK_LONG["steps"],
            QUICK_LONG["size"],
        )
    if args.only != "strategies":
        long_video_table(args.long_frames, args.long_steps, args.long_size, args.long_out)
    if args.only == "long":
        return
    shape = (args.size, args.frames, args.steps)

    rows = []
    base = one_device(*shape)
    params = sum(p.numel() for p in pipeline().transformer.parameters())
    latent_range = float(base["latents"].max() - base["latents"].min())
    for strategy in args.strategies.split(","):
        with RankPool(2, timeout_s=7200, threads_per_rank=1) as pool:  # fresh processes: their memory untouched
            ranks = pool.run(on_ranks, *STRATEGIES[strategy], *shape)
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
