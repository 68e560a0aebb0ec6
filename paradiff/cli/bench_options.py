"""`paradiff bench`'s options turned into a :class:`~paradiff.bench.job.BenchJob`, checked before any worker starts."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..bench.job import DEFAULT_PROMPTS, BenchJob
from ..caches import parse_cache
from ..config import ParallelConfig
from ..errors import ParadiffError
from ..loading import call_arguments, check_model, default_size
from .argument_checks import check_numbers, given_prompts, resolve_nproc, resolve_steps, threads_per_rank


def job_from_args(args: argparse.Namespace, threads: int | None = None) -> BenchJob:
    """Validate the ``bench`` options (creating ``--out``) so that bad input fails here, not in a worker.

    The world size is ``checks.resolve_nproc``'s (torchrun's, ``--nproc`` or the machine's default);
    ``threads`` None: ``checks.threads_per_rank``'s default.
    """
    check_numbers(args)
    if args.prompts is not None and args.prompts < 1:
        raise ParadiffError(f"--prompts must be at least 1, got {args.prompts}")
    nproc = resolve_nproc(args)
    if nproc < 2:
        raise ParadiffError(f"bench compares N ranks with one device; use --nproc 2 or more, got {nproc}")
    texts = tuple(given_prompts(args))
    if texts and args.prompts is not None:
        raise ParadiffError("--prompts N draws N built-in scenes; leave it out with --prompt or --prompts-file")
    strategies = comma_list(args.strategies, "--strategies")
    warmups = tuple(warmup_setting(item) for item in comma_list(args.warmup, "--warmup"))
    floors = args.fidelity_floor and comma_list(args.fidelity_floor, "--fidelity-floor")
    floors = tuple(floor_setting(item) for item in floors or ())
    for strategy in strategies:
        ParallelConfig(strategy=strategy)  # raises "unknown strategy 'x'; available: ..."; the ranks check the world
    caches = tuple(dict.fromkeys(args.cache or ()))
    for cache in caches:
        parse_cache(cache)  # raises "unknown cache 'x'; available: ..." or names the settings' JSON error
    check_model(args.model)
    _make_writable_folder(args.out)
    return BenchJob(
        model=args.model,
        strategies=strategies,
        warmups=warmups,
        nproc=nproc,
        prompts=len(texts) if texts else (args.prompts or DEFAULT_PROMPTS),
        steps=resolve_steps(args),
        size=args.size or default_size(args.model),
        width=args.width,
        seed=args.seed,
        threads=threads_per_rank(threads, nproc),
        out=args.out,
        call=call_arguments(args.call),
        prompt_texts=texts,
        device=args.device,
        dtype=args.dtype,
        guidance=args.guidance,
        negative_prompt=args.negative_prompt,
        json=getattr(args, "json", False),
        timeout_s=args.timeout,
        caches=caches,
        floors=floors,
    )


def comma_list(text: str, option: str) -> tuple[str, ...]:
    """The items of a comma-separated option, each once, in order."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ParadiffError(f"{option} takes a comma-separated list without empty items, got {text!r}")
    return tuple(dict.fromkeys(items))


def warmup_setting(item: str) -> int:
    if not (item.isascii() and item.isdigit()):
        raise ParadiffError(f"--warmup takes integers >= 0 (synchronous steps after the first), got {item!r}")
    return int(item)


def _make_writable_folder(out: str) -> None:
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ParadiffError(f"cannot create the --out folder {out}: {error.strerror or error}") from error
    if not os.access(out, os.W_OK):
        raise ParadiffError(f"cannot write into the --out folder {out}")


def floor_setting(item: str) -> float:
    try:
        floor = float(item)
    except ValueError:
        floor = math.nan
    if not 0 < floor < math.inf:
        raise ParadiffError(f"--fidelity-floor takes positive numbers of dB (e.g. 30,40), got {item!r}")
    return floor
