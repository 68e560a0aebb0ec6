"""What the recipes share: their command line, the offline pipelines behind ``--model``, the report on rank 0.

A recipe keeps what a user writes (``from_pretrained``, ``paradiff.parallelize``, ``pipe(...)``); this
module keeps the rest out of its way. ``--model tiny`` builds the family's random-weight pipeline from
:mod:`paradiff.tiny` (no download and no text encoder: the prompt becomes seeded embeddings), and the
built-in names of :mod:`paradiff.loading` load through it, so every recipe also runs offline in CI.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

import paradiff
from paradiff.loading import RANDOM_MODELS, TRAINED_MODELS, load_pipeline, prompt_kwargs
from paradiff.strategies import strategy_names

TINY = "tiny"
TINY_SIZE = 64
RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


def builtin_models(family: str) -> list[str]:
    """paradiff's own pipelines of ``family`` that ``--model`` accepts besides ``tiny``."""
    return [name for name, kind in {**TRAINED_MODELS, **RANDOM_MODELS}.items() if kind == family]


def parse_args(family: str, doc: str, model: str, size: int, steps: int) -> argparse.Namespace:
    """The recipes' command line; ``model``, ``size`` and ``steps`` are the family's usual defaults."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ", ".join([TINY, *builtin_models(family)])
    parser.add_argument("--model", default=model, help=f"hub id or local folder (default {model}), or {names}")
    parser.add_argument("--prompt", default="an astronaut riding a horse on the moon, photograph")
    parser.add_argument("--strategy", default="patch", choices=strategy_names())
    parser.add_argument("--warmup", type=int, default=4, help="synchronous steps after the first (default 4)")
    parser.add_argument("--steps", type=int, default=steps, help=f"inference steps (default {steps})")
    parser.add_argument("--size", type=int, help=f"height and width in pixels (default {size}, {TINY_SIZE} for tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"{family}.png")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank on CPU (default cores / ranks)")
    args = parser.parse_args(namespace=argparse.Namespace(family=family))
    if args.size is None:
        args.size = TINY_SIZE if args.model == TINY else size
    return args


def dtype(cuda_dtype: torch.dtype) -> torch.dtype:
    """``cuda_dtype`` on the GPU, float32 on the CPU (whose half-precision kernels are slow or missing)."""
    return cuda_dtype if torch.cuda.is_available() else torch.float32


def device() -> torch.device:
    """This rank's device: the GPU torchrun's ``LOCAL_RANK`` names, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load(args: argparse.Namespace, from_pretrained: Callable, **options) -> tuple[object, dict]:
    """The pipeline ``--model`` names on this rank's device, and the inputs of its call.

    Hub ids and folders load with ``from_pretrained(args.model, **options)``. The inputs are the prompt
    (the tiny model's embeddings instead) and a generator seeded with ``--seed``.
    """
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // WORLD_SIZE))
    if args.model == TINY:
        from paradiff.tiny import build_pipeline, prompt_inputs  # imports every family's pipeline: only when asked

        pipe = build_pipeline(args.family, size="tiny").to(device())
        inputs = prompt_inputs(pipe, args.family)
    elif args.model in builtin_models(args.family):
        pipe = load_pipeline(args.model).to(device())
        inputs = prompt_kwargs(pipe, args.model, args.prompt)
    else:
        pipe = from_pretrained(args.model, **options).to(device())
        inputs = {"prompt": args.prompt}
    pipe.set_progress_bar_config(disable=RANK != 0)
    return pipe, {**inputs, "generator": torch.Generator().manual_seed(args.seed)}


@contextmanager
def report(args: argparse.Namespace, pipe) -> Iterator[SimpleNamespace]:
    """Time the ``with`` block; then, on rank 0, save ``result.image`` and print the latency and the traffic.

    Every rank holds the same image, so one writes it.
    """
    result = SimpleNamespace(image=None)
    start = time.perf_counter()
    yield result
    seconds = time.perf_counter() - start
    if RANK != 0:
        return
    result.image.save(args.out)
    size = f"{result.image.width}x{result.image.height}"
    print(f"wrote {args.out} ({size}): {args.steps} steps in {seconds:.2f} s on {WORLD_SIZE} rank(s)")
    if WORLD_SIZE > 1:
        stats = paradiff.comm_stats(pipe)
        exchanges = f"{stats['sync_layer_exchanges']} synchronous, {stats['stale_layer_exchanges']} displaced"
        megabytes = stats["bytes_per_step"] / 1e6
        print(f"per rank: {megabytes:.2f} MB/step sent, waited {stats['wait_s']:.2f} s, layer exchanges {exchanges}")
