"""The ``paradiff`` command."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from .errors import ParadiffError
from .launch import ranks_to_use, run_on_ranks
from .loading import DEFAULT_MODEL, MODEL_NAMES, check_model, load_pipeline, prompt_kwargs
from .strategies import strategy_names


@dataclass(frozen=True)
class GenerateJob:
    prompt: str
    model: str
    strategy: str
    nproc: int
    steps: int
    size: int | None
    frames: int | None
    seed: int
    warmup: int
    out: str | None
    baseline: bool
    threads: int

    def call_kwargs(self) -> dict:
        """Size and frame count, only where given: otherwise the pipeline's own defaults apply."""
        sizes = {"height": self.size, "width": self.size, "num_frames": self.frames}
        return {name: value for name, value in sizes.items() if value is not None}


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
            **job.call_kwargs(),
            num_inference_steps=job.steps,
            generator=torch.Generator().manual_seed(job.seed),
            output_type="np",
        )
        return _output_of(result), time.perf_counter() - start

    baseline = baseline_s = None
    if job.nproc > 1:
        if job.baseline and rank == 0:
            print(f"[paradiff] one device, {job.threads} thread(s): generating the reference", flush=True)
            baseline, baseline_s = generate()
        dist.barrier()
        pipe = paradiff.parallelize(pipe, strategy=job.strategy, warmup_steps=job.warmup)
        if rank == 0:
            print(f"[paradiff] {job.nproc} ranks, strategy {job.strategy}", flush=True)
    images, latency_s = generate()
    if rank != 0:
        return {}
    report = {"out": save_output(images, job.out), "latency_s": latency_s}
    if baseline is not None:
        report.update(baseline_s=baseline_s, speedup=baseline_s / latency_s, psnr_db=psnr(images, baseline))
    if job.nproc > 1:
        report.update(paradiff.comm_stats(pipe))
    return report


def _output_of(result) -> np.ndarray:
    """An image pipeline's images ``(B, H, W, 3)`` or a video pipeline's frames ``(B, F, H, W, 3)``."""
    frames = getattr(result, "frames", None)
    return np.asarray(result.images if frames is None else frames)


def save_output(output: np.ndarray, out: str | None) -> str:
    """Write the first image (PNG, or the ``--out`` format) or the first video (MP4); returns the path."""
    video = output.ndim == 5
    path = Path(out or ("paradiff.mp4" if video else "paradiff.png"))
    if video:
        from diffusers.utils import export_to_video

        if path.suffix.lower() != ".mp4":
            path = path.with_suffix(".mp4")
            print(f"[paradiff] the model makes videos: writing {path}", flush=True)
        export_to_video(list(output[0]), str(path), fps=8)
    else:
        from diffusers.utils import numpy_to_pil

        numpy_to_pil(output)[0].save(path)
    return str(path)


def _check_job(job: GenerateJob) -> None:
    if job.nproc < 1:
        raise ParadiffError(f"--nproc must be at least 1, got {job.nproc}")
    if job.steps < 1:
        raise ParadiffError(f"--steps must be at least 1, got {job.steps}")
    if job.size is not None and (job.size < 8 or job.size % 8):
        raise ParadiffError(f"--size must be a positive multiple of 8, got {job.size}")
    if job.frames is not None and job.frames < 1:
        raise ParadiffError(f"--frames must be at least 1, got {job.frames}")
    out_dir = Path(job.out).resolve().parent if job.out else Path.cwd()
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        raise ParadiffError(
            f"cannot write {job.out or 'the output'}: folder {out_dir} does not exist or is not writable"
        )
    check_model(job.model)


def _threads_per_rank(args: argparse.Namespace) -> int:
    return args.threads or max(1, (os.cpu_count() or 1) // max(args.nproc, 1))


def generate(args: argparse.Namespace) -> int:
    threads = _threads_per_rank(args)
    job = GenerateJob(
        prompt=args.prompt,
        model=args.model,
        strategy=args.strategy,
        nproc=ranks_to_use(args.nproc),
        steps=args.steps,
        size=args.size,
        frames=args.frames,
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


#: Packages only ``paradiff bench`` needs (its figures and fidelity metrics): the ``bench`` extra.
BENCH_PACKAGES = ("matplotlib", "torchmetrics")


def _require_bench_extra() -> None:
    missing = [name for name in BENCH_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ParadiffError(
            f"paradiff bench needs {', '.join(missing)}, which the core install leaves out; "
            "pip install 'paradiff[bench]'"
        )


def bench(args: argparse.Namespace) -> int:
    """One device, then every strategy × warm-up on N ranks, same prompts and seeds; writes a report."""
    _require_bench_extra()
    from .bench.job import job_from_args

    job = job_from_args(args, threads=_threads_per_rank(args))
    from .bench.run import bench_on_rank

    results = run_on_ranks(bench_on_rank, job.nproc, job)
    if results is not None:
        from .bench.report import write_report

        print("\n".join(write_report(job, results)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradiff", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate an image or video on N ranks and report the speedup")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(MODEL_NAMES)}, a folder or a hub id")
    gen.add_argument("--strategy", default="patch", choices=strategy_names())
    gen.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    gen.add_argument("--steps", type=int, default=20)
    gen.add_argument("--size", type=int, help="height and width in pixels (default: the model's own)")
    gen.add_argument("--frames", type=int, help="frames, for video pipelines (default: the model's own)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--warmup", type=int, default=4, help="synchronous steps after the first")
    gen.add_argument("--out", help="image or video file (default: paradiff.png, or paradiff.mp4 for video models)")
    gen.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / nproc)")
    gen.add_argument("--no-baseline", action="store_true", help="skip the one-device reference run")
    gen.set_defaults(func=generate)
    ben = commands.add_parser("bench", help="one device vs each strategy and warm-up: speed, fidelity, report")
    ben.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(MODEL_NAMES)}, a folder or a hub id")
    ben.add_argument("--strategies", default="patch", help=f"comma list of {', '.join(strategy_names())}")
    ben.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    ben.add_argument(
        "--warmup", default="1,4", help="comma list of warm-up settings (synchronous steps after the first)"
    )
    ben.add_argument("--prompts", type=int, default=4, help="number of prompts (prompt i uses seed + i)")
    ben.add_argument("--out", default="paradiff-bench", help="folder for results.json, report.md/html and images")
    ben.add_argument("--steps", type=int, default=20)
    ben.add_argument("--size", type=int, help="height and width in pixels (default: the model's own)")
    ben.add_argument("--seed", type=int, default=0)
    ben.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / nproc)")
    ben.set_defaults(func=bench)
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
