"""The built-in models on one device and on 2 CPU ranks, per image size and strategy, side by side in one run.

    python benchmarks/builtin_default_bench.py --follow 24          # U-Net, 128-512 px; patch, cfg, parastep, asyncdiff
    python benchmarks/builtin_default_bench.py --model paradiff-tiny-dit --sizes 256,384,512,640,768 \
        --strategies cfg,patch,parastep,asyncdiff,pipefusion,ulysses --follow 24
    python benchmarks/builtin_default_bench.py --sizes 512 --strategies cfg --model paradiff-tiny-dit --repeats 3
    python benchmarks/builtin_default_bench.py --quick              # a smoke run: 128 px, cfg, 4 steps

What ``paradiff generate`` compares, at each size: one device is this process with
``cores // ranks`` = 1 torch thread; the parallel run is 2 gloo ranks on loopback with 1 thread each;
20 steps, warm-up 4, prompted as ``paradiff.builtin.call_kwargs`` prompts (the built-in guidance; the
PixArt pipeline draws at the asked size instead of at 256 px, resized). Each process makes one untimed
call at each size first, so neither side pays first-call costs. Each prompt (``--prompts``, default
the first two README examples) is drawn ``--repeats`` times on one device and on the ranks,
alternating, with seed = the prompt's index. Per size × strategy: median latency (and range) on one
device and on 2 ranks, the speedup of the medians, the PSNR of the rank image against the one-device
image (mean over prompts), and how many images follow their prompt (``tests/scene_analysis.misses``:
asked colours present, in the asked place, on the asked background) on one device and on the ranks.

``--follow N`` first reads the first N held-out prompts (``paradiff.builtin.scenes.HELD_OUT_PROMPTS``,
seeds 0..N-1) at each size on one device with ``paradiff.builtin.follow``: shape, colour, place and
background right. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import bench_common  # noqa: F401  (puts tests/ on sys.path)
import numpy as np
import torch
from rank_workers import RankPool
from scene_analysis import misses

from paradiff.builtin import EXAMPLE_PROMPTS, call_kwargs
from paradiff.loading import TRAINED_MODELS
from paradiff.metrics import psnr

PROMPTS = EXAMPLE_PROMPTS[:2]
QUICK = {"sizes": "128", "strategies": "cfg", "steps": 4, "repeats": 1}

_PIPES: dict = {}


def pipeline(model: str):
    """The built-in pipeline ``model``, loaded once per process, progress bar off."""
    if model not in _PIPES:
        from paradiff.loading import load_pipeline

        _PIPES[model] = load_pipeline(model)
        _PIPES[model].set_progress_bar_config(disable=True)
    return _PIPES[model]


def draw(pipe, model: str, prompt: str, size: int, steps: int, seed: int):
    """``(image, seconds)`` of one call, prompted as ``paradiff.builtin.call_kwargs`` prompts."""
    start = time.perf_counter()
    image = pipe(
        **call_kwargs(TRAINED_MODELS[model], prompt, warn=False),
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).images[0]
    return image, time.perf_counter() - start


def one_device(model: str, size: int, steps: int, prompts: list[str]) -> list[dict]:
    torch.set_num_threads(1)
    pipe = pipeline(model)
    draw(pipe, model, prompts[0], size, 2, 0)  # first-call allocations at this size out of the timed runs
    results = []
    for seed, prompt in enumerate(prompts):
        image, seconds = draw(pipe, model, prompt, size, steps, seed)
        results.append({"image": image, "latency_s": seconds})
    return results


def on_ranks(model: str, size: int, steps: int, prompts: list[str], strategy: str, warmup: int) -> list[dict]:
    import torch.distributed as dist

    import paradiff

    plain = pipeline(model)
    draw(plain, model, prompts[0], size, 2, 0)
    pipe = paradiff.parallelize(plain, strategy=strategy, warmup_steps=warmup)
    try:
        draw(pipe, model, prompts[0], size, 2, 0)
        results = []
        for seed, prompt in enumerate(prompts):
            dist.barrier()
            image, seconds = draw(pipe, model, prompt, size, steps, seed)
            results.append({"image": image if dist.get_rank() == 0 else None, "latency_s": seconds})
        stats = paradiff.comm_stats(pipe)
    finally:
        paradiff.unparallelize(pipe)
    for result in results:
        result["bytes_per_step"] = stats["bytes_per_step"]
    return results


def follow_rates(model: str, size: int, steps: int, count: int) -> dict:
    """The first ``count`` held-out prompts at ``size`` on one device, read by the follow measure."""
    from paradiff.builtin.follow import CHECKS, judge
    from paradiff.builtin.scenes import HELD_OUT_PROMPTS

    torch.set_num_threads(1)
    counts = dict.fromkeys(CHECKS, 0)
    start = time.perf_counter()
    for seed, prompt in enumerate(HELD_OUT_PROMPTS[:count]):
        image, _ = draw(pipeline(model), model, prompt, size, steps, seed)
        for check, right in judge(image, prompt).items():
            counts[check] += right
    seconds = (time.perf_counter() - start) / count
    return {"model": model, "px": size, "prompts": count, **counts, "s_per_image": seconds}


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pictures = [model for model, kind in TRAINED_MODELS.items() if kind != "video"]
    parser.add_argument("--model", default="paradiff-tiny", choices=pictures)
    parser.add_argument("--sizes", default="128,192,256,320,384,512")
    parser.add_argument("--strategies", default="patch,cfg,parastep,asyncdiff")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="times each prompt is drawn, per side")
    parser.add_argument("--prompts", default="|".join(PROMPTS), help="'|'-separated prompts")
    parser.add_argument("--follow", type=int, default=0, help="also read the test's N prompts per size")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", default="benchmarks/out/builtin_default_bench.json")
    args = parser.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    sizes = [int(size) for size in args.sizes.split(",")]
    prompts = args.prompts.split("|")
    strategies = args.strategies.split(",")

    follow = []
    for size in sizes if args.follow else ():
        follow.append(follow_rates(args.model, size, args.steps, args.follow))
        print(_follow_table(follow[-1:]), flush=True)

    rows = []
    with RankPool(2, timeout_s=3600, threads_per_rank=1) as pool:
        for size in sizes:
            for strategy in strategies:
                base_runs, rank_runs = [], []
                for _ in range(args.repeats):  # alternate, so host drift hits both sides alike
                    base_runs.append(one_device(args.model, size, args.steps, prompts))
                    rank_runs.append(pool.run(on_ranks, args.model, size, args.steps, prompts, strategy, args.warmup))
                base_s = [r["latency_s"] for run in base_runs for r in run]
                ranks_s = [max(rank[i]["latency_s"] for rank in run) for run in rank_runs for i in range(len(prompts))]
                base_images = [r["image"] for r in base_runs[0]]
                rank_images = [r["image"] for r in rank_runs[0][0]]
                rows.append(
                    {
                        "model": args.model,
                        "px": size,
                        "strategy": strategy,
                        "steps": args.steps,
                        "warmup": args.warmup,
                        "one_device_s": base_s,
                        "two_ranks_s": ranks_s,
                        "speedup": statistics.median(base_s) / statistics.median(ranks_s),
                        "psnr_db": float(np.mean([psnr(a, b) for a, b in zip(rank_images, base_images, strict=True)])),
                        "bytes_per_step": rank_runs[0][0][0]["bytes_per_step"],
                        "prompts": prompts,
                        "one_device_misses": [misses(image, p) for image, p in zip(base_images, prompts, strict=True)],
                        "two_ranks_misses": [misses(image, p) for image, p in zip(rank_images, prompts, strict=True)],
                    }
                )
                print(_table(rows[-1:]), flush=True)

    if follow:
        print("\n" + _follow_table(follow))
    print("\n" + _table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"torch_threads_per_rank": 1, "ranks": 2, "quick": args.quick, "follow": follow, "rows": rows}
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


def _follow_table(rows: list[dict]) -> str:
    lines = [
        "| model | px | shape | colour | place | background | s/image (1 thread) |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['px']} | {r['shape']}/{r['prompts']} | {r['colour']}/{r['prompts']} "
            f"| {r['place']}/{r['prompts']} | {r['background']}/{r['prompts']} | {r['s_per_image']:.2f} |"
        )
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    head = (
        "| model | px | strategy | 1 device s, median (range) | 2 ranks s, median (range) | speedup "
        "| MB/step/rank | PSNR dB | followed, 1 device | followed, 2 ranks |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        count = len(r["prompts"])
        lines.append(
            f"| {r['model']} | {r['px']} | {r['strategy']} | {median_range(r['one_device_s'])} "
            f"| {median_range(r['two_ranks_s'])} | {r['speedup']:.2f}x | {r['bytes_per_step'] / 1e6:.3f} "
            f"| {r['psnr_db']:.1f} | {sum(not m for m in r['one_device_misses'])}/{count} "
            f"| {sum(not m for m in r['two_ranks_misses'])}/{count} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
