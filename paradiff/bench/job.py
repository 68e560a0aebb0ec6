"""The settings of one ``paradiff bench``, checked before any worker starts, and the runs they mean."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..cli.checks import check_numbers, check_world, given_prompts, resolve_nproc, threads_per_rank
from ..config import ParallelConfig
from ..errors import ParadiffError
from ..loading import call_arguments, check_model, default_size
from ..strategies import strategy_class
from .prompts import bench_prompts

#: How many built-in scenes bench draws when neither ``--prompts`` nor ``--prompt``/``--prompts-file`` is given.
DEFAULT_PROMPTS = 4


@dataclass(frozen=True)
class RunSpec:
    """One row of the report: the one-device baseline (no strategy) or one strategy at one warm-up."""

    strategy: str | None = None
    warmup: int | None = None

    @property
    def label(self) -> str:
        if self.strategy is None:
            return "one device"
        return self.strategy if self.warmup is None else f"{self.strategy} warmup={self.warmup}"


ONE_DEVICE = RunSpec()


@dataclass(frozen=True)
class BenchJob:
    model: str
    strategies: tuple[str, ...]
    warmups: tuple[int, ...]
    nproc: int
    prompts: int
    steps: int
    size: int | None  # None: the model's own (loading.default_size)
    seed: int
    threads: int
    out: str
    #: More arguments of the pipeline's call (``--call``), as ``(key, value)`` pairs.
    call: tuple = ()
    #: Width in pixels when it differs from ``size`` (the height).
    width: int | None = None
    #: The user's prompts (``--prompt``, ``--prompts-file``); empty: ``prompts`` built-in scenes.
    prompt_texts: tuple[str, ...] = ()
    device: str = "auto"  # auto (CUDA when present), cuda or cpu: every rank and the one-device run
    dtype: str = "auto"  # auto (float16 on CUDA, float32 on the CPU) or one of devices.DTYPES
    guidance: float | None = None  # None: the built-in models' own (2), the pipeline's default otherwise
    negative_prompt: str | None = None
    #: ``--json``: the progress lines go to stderr, so that stdout holds only the JSON object.
    json: bool = False
    #: The longest a collective waits for another rank (``--timeout``, ``parallelize``'s ``timeout_s``).
    timeout_s: float = 600.0

    def prompt_list(self, video: bool = False) -> list[str]:
        """The prompts every run draws: the user's, or ``prompts`` built-in scenes (moving ones for video)."""
        return list(self.prompt_texts) if self.prompt_texts else bench_prompts(self.prompts, video=video)

    def runs(self) -> list[RunSpec]:
        """The baseline first, then every strategy × warm-up in the order given (once for exact strategies)."""
        runs = [ONE_DEVICE]
        for strategy in self.strategies:
            warmups = self.warmups if strategy_class(strategy).uses_warmup else (None,)
            runs += [RunSpec(strategy, warmup) for warmup in warmups]
        return runs

    def command(self) -> str:
        """The command line that reproduces this job, every option spelled out."""
        options = {
            "--model": self.model,
            "--strategies": ",".join(self.strategies),
            "--warmup": ",".join(map(str, self.warmups)),
            "--nproc": self.nproc,
            "--prompts": None if self.prompt_texts else self.prompts,
            "--steps": self.steps,
            "--size": self.size,
            "--width": self.width,
            "--seed": self.seed,
            "--threads": self.threads,
            "--device": self.device,
            "--dtype": self.dtype,
            "--guidance": self.guidance,
            "--negative-prompt": self.negative_prompt,
            "--out": self.out,
        }
        given = {option: value for option, value in options.items() if value is not None}
        prompts = [part for prompt in self.prompt_texts for part in ("--prompt", prompt)]
        calls = [part for key, value in self.call for part in ("--call", f"{key}={json.dumps(value)}")]
        parts = [str(part) for item in given.items() for part in item]
        return shlex.join(["paradiff", "bench", *parts, *prompts, *calls])


def job_from_args(args: argparse.Namespace, threads: int | None = None) -> BenchJob:
    """Validate the ``bench`` options (creating ``--out``) so that bad input fails here, not in a worker.

    The world size is ``paradiff.cli.checks.resolve_nproc``'s (torchrun's, ``--nproc`` or the machine's default);
    ``threads`` None: ``paradiff.cli.checks.threads_per_rank``'s default.
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
    for strategy in strategies:
        ParallelConfig(strategy=strategy)  # raises "unknown strategy 'x'; available: ..."
        check_world(strategy, nproc)  # raises "strategy='cfg' runs ... got a world of 3 ..."
    check_model(args.model)
    _make_writable_folder(args.out)
    return BenchJob(
        model=args.model,
        strategies=strategies,
        warmups=warmups,
        nproc=nproc,
        prompts=len(texts) if texts else (args.prompts or DEFAULT_PROMPTS),
        steps=args.steps,
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
