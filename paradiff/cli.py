"""The ``paradiff`` command."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .config import STRATEGY_NAMES
from .errors import ParadiffError
from .launch import run_on_ranks
from .loading import DEFAULT_MODEL, MODEL_NAMES, check_model, load_pipeline, prompt_kwargs


@dataclass(frozen=True)
class GenerateJob:
    prompt: str
    model: str
    strategy: str
    nproc: int
    steps: int
    size: int
    seed: int
    warmup: int
    out: str
    baseline: bool
    threads: int


def _generate_on_rank(job: GenerateJob) -> dict:
    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.metrics import psnr
    from paradiff.runtime.distributed import ensure_process_group

    torch.set_num_threads(job.threads)
    if job.nproc > 1:
        ensure_process_group(timedelta(minutes=30))
    rank = dist.get_rank() if dist.is_initialized() else 0
    pipe = load_pipeline(job.model)
    pipe.set_progress_bar_config(disable=rank != 0)
    inputs = prompt_kwargs(pipe, job.model, job.prompt)

    def generate():
        start = time.perf_counter()
        result = pipe(
            **inputs,
            height=job.size,
            width=job.size,
            num_inference_steps=job.steps,
            generator=torch.Generator().manual_seed(job.seed),
            output_type="np",
        )
        return result.images, time.perf_counter() - start

    baseline = baseline_s = None
    if job.baseline and rank == 0:
        print(f"[paradiff] one device, {job.threads} thread(s): generating the reference image", flush=True)
        baseline, baseline_s = generate()
    if dist.is_initialized():
        dist.barrier()
    pipe = paradiff.parallelize(pipe, strategy=job.strategy, warmup_steps=job.warmup)
    if rank == 0:
        print(f"[paradiff] {job.nproc} rank(s), strategy {job.strategy}", flush=True)
    images, latency_s = generate()
    if rank != 0:
        return {}
    from diffusers.utils import numpy_to_pil

    numpy_to_pil(images)[0].save(job.out)
    report = {"out": job.out, "latency_s": latency_s}
    if baseline is not None:
        report.update(baseline_s=baseline_s, speedup=baseline_s / latency_s, psnr_db=psnr(images, baseline))
    if job.nproc > 1:
        report.update(paradiff.comm_stats(pipe))
    return report


def _check_job(job: GenerateJob) -> None:
    if job.nproc < 1:
        raise ParadiffError(f"--nproc must be at least 1, got {job.nproc}")
    if job.steps < 1:
        raise ParadiffError(f"--steps must be at least 1, got {job.steps}")
    out_dir = Path(job.out).resolve().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        raise ParadiffError(f"cannot write {job.out}: folder {out_dir} does not exist or is not writable")
    check_model(job.model)


def generate(args: argparse.Namespace) -> int:
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(args.nproc, 1))
    job = GenerateJob(
        prompt=args.prompt,
        model=args.model,
        strategy=args.strategy,
        nproc=args.nproc,
        steps=args.steps,
        size=args.size,
        seed=args.seed,
        warmup=args.warmup,
        out=args.out,
        baseline=not args.no_baseline,
        threads=threads,
    )
    _check_job(job)
    report = run_on_ranks(_generate_on_rank, job.nproc, job)
    if report:
        print(f"wrote {report['out']}")
        print(f"latency: {report['latency_s']:.2f} s on {job.nproc} rank(s)")
        if "speedup" in report:
            print(
                f"one device: {report['baseline_s']:.2f} s -> speedup {report['speedup']:.2f}x, "
                f"PSNR vs one device {report['psnr_db']:.1f} dB"
            )
        if "bytes_per_step" in report:
            print(f"moved {report['bytes_per_step'] / 1e6:.2f} MB per step per rank, waited {report['wait_s']:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradiff", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate an image on N ranks and report the speedup")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(MODEL_NAMES)}, a folder or a hub id")
    gen.add_argument("--strategy", default="patch", choices=STRATEGY_NAMES)
    gen.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    gen.add_argument("--steps", type=int, default=20)
    gen.add_argument("--size", type=int, default=512, help="height and width in pixels")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--warmup", type=int, default=4, help="synchronous steps after the first")
    gen.add_argument("--out", default="paradiff.png")
    gen.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / nproc)")
    gen.add_argument("--no-baseline", action="store_true", help="skip the one-device reference run")
    gen.set_defaults(func=generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ParadiffError as error:
        print(f"paradiff: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
