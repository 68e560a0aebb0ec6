"""A video VAE's decode on 2 ranks: whole on every rank (``parallel_vae=False``) vs on rank 0 for both.

    python benchmarks/vae_decode_bench.py            # Wan VAE (base width 64), 17 frames at 256 px
    python benchmarks/vae_decode_bench.py --quick    # 5 frames at 64 px

Video VAEs carry a cache from one chunk of frames to the next, so paradiff decodes them on rank 0 and
broadcasts the frames (``paradiff.layers.decode_broadcast``). Prints, per rank, the decode's latency and its
working memory (how far the resident set grew above its size at the decode's start), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench_common  # noqa: F401  (puts tests/ on the import path)
import torch
from bench_common import status_mb
from rank_workers import RankPool

from paradiff.tiny import build

QUICK = {"size": 64, "frames": 5}
#: A Wan VAE of a quarter of the real one's width (96): big enough that the decode's activations dominate.
VAE_WIDTH = 64


def decode(size: int, frames: int, parallel_vae: bool) -> dict:
    import torch.distributed as dist

    import paradiff

    torch.set_num_threads(1)
    pipe, _ = build("wan")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.vae = type(pipe.vae).from_config({**pipe.vae.config, "base_dim": VAE_WIDTH}).eval()
    pipe = paradiff.parallelize(pipe, strategy="cfg", parallel_vae=parallel_vae)
    latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
    latents = torch.randn(1, 16, latent_frames, size // 8, size // 8, generator=torch.Generator().manual_seed(0))
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = status_mb("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        video = pipe.vae.decode(latents, return_dict=False)[0]
    seconds = time.perf_counter() - start
    working = status_mb("VmHWM") - before
    paradiff.unparallelize(pipe)
    return {"seconds": seconds, "working_mb": working, "frames": list(video.shape), "sum": float(video.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", default="benchmarks/out/vae_decode_bench.json")
    args = parser.parse_args()
    if args.quick:
        args.size, args.frames = QUICK["size"], QUICK["frames"]
    rows = []
    for parallel_vae in (False, True):
        with RankPool(2, timeout_s=3600, threads_per_rank=1) as pool:  # fresh processes: a clean high-water mark
            ranks = pool.run(decode, args.size, args.frames, parallel_vae)
        assert ranks[0]["sum"] == ranks[1]["sum"]
        for rank, result in enumerate(ranks):
            rows.append({"parallel_vae": parallel_vae, "rank": rank, **result})
    print(f"Wan VAE (base width {VAE_WIDTH}), {args.frames} frames at {args.size} px, 2 ranks")
    print("| decode | rank | seconds | working MB |")
    print("|---|---|---|---|")
    for row in rows:
        mode = "rank 0, broadcast" if row["parallel_vae"] else "whole on every rank"
        print(f"| {mode} | {row['rank']} | {row['seconds']:.1f} | {row['working_mb']:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"size": args.size, "frames": args.frames, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
