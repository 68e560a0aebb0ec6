"""Step caches stacked on strategies: each cache on one device and under ``cfg``, ``patch``, ``parastep`` (2 CPU ranks).

    python benchmarks/cache_bench.py                 # bench-size Flux-style DiT, true CFG, 256 px, 20 steps
    python benchmarks/cache_bench.py --quick         # a smoke run: 64 px, 4 steps

The pipeline is the bench-size Flux-style DiT of ``paradiff.tiny`` with a negative prompt and ``true_cfg_scale=2``
(two transformer calls per step, a ``cache_context`` each, as FirstBlockCache and TaylorSeer need). Each cache of
:data:`CACHES` (``paradiff.caches.presets`` names and settings; MagCache's ratios are calibrated on one device in the
same run) runs on one device, then under each strategy of :data:`STRATEGIES` on 2 ranks (``patch`` and ``parastep``
with ``--warmup`` synchronous steps, ``cfg`` exact), and so does the uncached pipeline. Per run: seconds, speedup over
the uncached one device, PSNR against the uncached one-device image and against the same cache on one device (inf:
identical), or the refusal. The runs alternate over ``--repeats`` rounds (medians); the host's ceiling (two
independent one-thread jobs at once) is measured in the same run. Prints a table and the best stacked setting against
the best uncached strategy, and writes JSON.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from bench_common import cached_pipeline
from cfg_bench import true_cfg_call
from rank_workers import RankPool

from paradiff.metrics import psnr

QUICK = {"size": 64, "steps": 4}
STRATEGIES = ("cfg", "patch", "parastep")
#: Each cache's settings (paradiff.caches.presets); "mag" gets its ratios from a calibration run.
CACHES = {
    "first-block": {"threshold": 0.5},
    "taylorseer": {"cache_interval": 3, "disable_cache_before_step": 3, "taylor_factors_dtype": "float32"},
    "pyramid": {"spatial_attention_block_skip_range": 2, "spatial_attention_timestep_skip_range": [100, 950]},
    "faster": {},
    "mag": {},
}


def timed(pipe, size: int, steps: int) -> tuple[np.ndarray, float]:
    images, seconds = true_cfg_call(pipe, size, steps)
    return images[0], seconds


@contextlib.contextmanager
def cache_on(pipe, cache: str | None, settings: dict, steps: int):
    from paradiff.caches.presets import apply_cache

    if cache is None:
        yield
        return
    remove = apply_cache(pipe, cache, steps, settings)
    try:
        yield
    finally:
        remove()


def calibrated_mag_ratios(size: int, steps: int) -> list[float]:
    """MagCache's magnitude ratios of this pipeline, from one calibrating call on one device (it prints them)."""
    pipe = cached_pipeline("flux")
    printed = io.StringIO()
    with cache_on(pipe, "mag", {"calibrate": True}, steps), contextlib.redirect_stdout(printed):
        timed(pipe, size, steps)
    lists = [
        ast.literal_eval(line)
        for line in printed.getvalue().splitlines()
        if line.startswith("[") and line.endswith("]")
    ]
    return lists[0]  # the "cond" calls' ratios (the "uncond" calls print theirs after)


def one_device(cache: str | None, settings: dict, size: int, steps: int) -> dict:
    torch.set_num_threads(1)
    with cache_on(cached_pipeline("flux"), cache, settings, steps):
        image, seconds = timed(cached_pipeline("flux"), size, steps)
    return {"image": image, "seconds": seconds}


def on_ranks(strategy: str | None, cache: str | None, settings: dict, size: int, steps: int, warmup: int) -> dict:
    """Under ``strategy`` (None: each rank alone, at once: the host's ceiling) with ``cache``; rank 0's figures."""
    import torch.distributed as dist

    import paradiff
    from paradiff.errors import ParadiffError

    pipe = cached_pipeline("flux")
    with cache_on(pipe, cache, settings, steps):
        try:
            if strategy is not None:
                pipe = paradiff.parallelize(pipe, strategy=strategy, warmup_steps=warmup)
            dist.barrier()
            image, seconds = timed(pipe, size, steps)
        except ParadiffError as error:
            return {"refused": str(error)}
        finally:
            if strategy is not None:
                paradiff.unparallelize(pipe)
    return {"image": image, "seconds": seconds} if dist.get_rank() == 0 else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="synchronous steps after the first (patch, parastep)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every run, alternated (medians)")
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", default="benchmarks/out/cache_bench.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps = QUICK["size"], QUICK["steps"]
    caches = {name: dict(CACHES[name]) for name in args.caches.split(",")}
    if "mag" in caches:
        caches["mag"]["mag_ratios"] = calibrated_mag_ratios(args.size, args.steps)
    settings = [(None, {}), *caches.items()]
    runs = [(cache, strategy) for cache, _ in settings for strategy in (None, *STRATEGIES)]
    seconds: dict = {run: [] for run in runs}
    images, refused, ceiling = {}, {}, []
    with RankPool(2, timeout_s=7200, threads_per_rank=1) as pool:
        for _ in range(args.repeats):
            alone = one_device(None, {}, args.size, args.steps)["seconds"]
            both = pool.run(on_ranks, None, None, {}, args.size, args.steps, args.warmup)[0]["seconds"]
            ceiling.append(2 * alone / both)
            for cache, strategy in runs:
                options = dict(settings)[cache]
                if strategy is None:
                    result = one_device(cache, options, args.size, args.steps)
                else:
                    result = pool.run(on_ranks, strategy, cache, options, args.size, args.steps, args.warmup)[0]
                if "refused" in result:
                    refused[(cache, strategy)] = result["refused"]
                    continue
                seconds[(cache, strategy)].append(result["seconds"])
                images[(cache, strategy)] = result["image"]
    base = statistics.median(seconds[(None, None)])
    rows = []
    print(f"{args.size} px, {args.steps} steps, warm-up {args.warmup}, 2 ranks; host ceiling {min(ceiling):.2f}x")
    print("| cache | run | s | speedup | PSNR vs 1 device dB | PSNR vs cached 1 device dB |")
    print("|---|---|---|---|---|---|")
    for cache, strategy in runs:
        run = strategy or "one device"
        if (cache, strategy) in refused:
            rows.append({"cache": cache, "run": run, "refused": refused[(cache, strategy)]})
            reason = refused[(cache, strategy)].split(":")[0].split(" (")[0]
            print(f"| {cache or 'none'} | {run} | refused: {reason} | | | |")
            continue
        median = statistics.median(seconds[(cache, strategy)])
        image = images[(cache, strategy)]
        row = {
            "cache": cache,
            "run": run,
            "seconds": median,
            "speedup": base / median,
            "psnr_db": psnr(image, images[(None, None)]),
            "psnr_vs_cached_db": psnr(image, images[(cache, None)]),
        }
        rows.append(row)
        print(
            f"| {cache or 'none'} | {run} | {median:.1f} | {row['speedup']:.2f}x | {row['psnr_db']:.1f} "
            f"| {row['psnr_vs_cached_db']:.1f} |"
        )
    timed_rows = [row for row in rows if "speedup" in row]
    uncached = max(
        (r for r in timed_rows if r["cache"] is None and r["run"] != "one device"), key=lambda r: r["speedup"]
    )
    stacked = max(
        (r for r in timed_rows if r["cache"] is not None and r["run"] != "one device"), key=lambda r: r["speedup"]
    )
    ratio = stacked["speedup"] / uncached["speedup"]
    print(
        f"best uncached strategy: {uncached['run']} {uncached['speedup']:.2f}x; best stacked: {stacked['cache']} + "
        f"{stacked['run']} {stacked['speedup']:.2f}x ({stacked['psnr_db']:.1f} dB): {ratio:.2f}x the best uncached"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    document = {
        "settings": vars(args),
        "caches": caches,
        "host_ceiling": ceiling,
        "rows": rows,
        "stacked_over_uncached": ratio,
    }
    Path(args.out).write_text(json.dumps(document, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
