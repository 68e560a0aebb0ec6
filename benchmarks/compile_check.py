"""``torch.compile`` of the denoiser under every strategy: speed with and without it, and exact mode still exact.

    python benchmarks/compile_check.py --size 256 --steps 8 --warmup 2

For each strategy (U-Net strategies on the bench-size random SD, DiT ones on the bench-size random PixArt),
on 2 CPU ranks: the call without compile, then ``denoiser.compile()`` after ``parallelize`` and the call
again (the first compiled call, which compiles, and the second, which is timed), and on one device the same
pair; then, with ``warmup_steps`` = steps (exact), the largest difference from one device. Prints a table
and writes JSON. Compiling takes tens of seconds per strategy on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from paradiff.launch import run_on_ranks

CASES = (("sd", "patch"), ("sd", "parastep"), ("sd", "asyncdiff"), ("sd", "cfg"), ("pixart", "pipefusion"))
CASES += (("pixart", "ulysses"),)


def on_ranks(family: str, strategy: str, size: int, steps: int, warmup: int) -> dict | None:
    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.models import find_denoiser
    from paradiff.tiny import build_pipeline, prompt_inputs

    torch.set_num_threads(1)

    def draw(pipe) -> tuple[np.ndarray, float]:
        generator = torch.Generator().manual_seed(0)
        inputs = prompt_inputs(pipe, family)
        start = time.perf_counter()
        call = {"height": size, "width": size, "num_inference_steps": steps, "output_type": "np"}
        images = pipe(**inputs, **call, generator=generator).images
        return images[0], time.perf_counter() - start

    rank = dist.get_rank()
    figures = {}
    if rank == 0:
        alone = build_pipeline(family, size="bench")
        draw(alone)
        reference, figures["one_device_s"] = draw(alone)
        find_denoiser(alone).compile()
        figures["one_device_compile_s"] = draw(alone)[1]
        figures["one_device_compiled_s"] = draw(alone)[1]
    dist.barrier()
    for mode, warmup_steps in (("displaced", warmup), ("exact", steps)):
        pipe = paradiff.parallelize(build_pipeline(family, size="bench"), strategy=strategy, warmup_steps=warmup_steps)
        if mode == "displaced":
            draw(pipe)
            figures["parallel_s"] = draw(pipe)[1]
        find_denoiser(pipe).compile()
        figures[f"{mode}_compile_s"] = draw(pipe)[1]
        image, figures[f"{mode}_compiled_s"] = draw(pipe)
        if mode == "exact" and rank == 0:
            figures["exact_error"] = float(np.abs(image - reference).max())  # images in [0, 1]
        paradiff.unparallelize(pipe)
        torch._dynamo.reset()
    return figures if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cases", default=",".join(f"{f}:{s}" for f, s in CASES), help="family:strategy,...")
    parser.add_argument("--out", default="benchmarks/out/compile_check.json")
    args = parser.parse_args()
    rows = []
    print("family  strategy    1 dev s  1 dev compiled s  2 ranks s  2 ranks compiled s  compile s  exact error")
    for family, strategy in (case.split(":") for case in args.cases.split(",")):
        figures = run_on_ranks(on_ranks, 2, family, strategy, args.size, args.steps, args.warmup, device="cpu")
        rows.append({"family": family, "strategy": strategy, **figures})
        print(
            f"{family:7s} {strategy:10s} {figures['one_device_s']:8.2f} {figures['one_device_compiled_s']:17.2f} "
            f"{figures['parallel_s']:10.2f} {figures['displaced_compiled_s']:19.2f} "
            f"{figures['displaced_compile_s']:10.1f} {figures['exact_error']:12.2e}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
