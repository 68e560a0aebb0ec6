"""The settings of one ``paradiff bench``, checked before any worker starts, and the runs they mean."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..config import ParallelConfig
from ..errors import ParadiffError
from ..loading import call_arguments, check_model, default_size
from ..strategies import strategy_class


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
            "--prompts": self.prompts,
            "--steps": self.steps,
            "--size": self.size,
            "--width": self.width,
            "--seed": self.seed,
            "--threads": self.threads,
            "--out": self.out,
        }
        given = {option: value for option, value in options.items() if value is not None}
        calls = [part for key, value in self.call for part in ("--call", f"{key}={json.dumps(value)}")]
        return shlex.join(["paradiff", "bench", *(str(part) for item in given.items() for part in item), *calls])


def job_from_args(args: argparse.Namespace, threads: int) -> BenchJob:
    """Validate the ``bench`` options (creating ``--out``) so that bad input fails here, not in a worker."""
    for option in ("nproc", "prompts", "steps", "size", "width"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ParadiffError(f"--{option} must be at least 1, got {value}")
    strategies = comma_list(args.strategies, "--strategies")
    warmups = tuple(warmup_setting(item) for item in comma_list(args.warmup, "--warmup"))
    for strategy in strategies:
        ParallelConfig(strategy=strategy)  # raises "unknown strategy 'x'; available: ..."
    check_model(args.model)
    _make_writable_folder(args.out)
    return BenchJob(
        model=args.model,
        strategies=strategies,
        warmups=warmups,
        nproc=args.nproc,
        prompts=args.prompts,
        steps=args.steps,
        size=args.size or default_size(args.model),
        width=args.width,
        seed=args.seed,
        threads=threads,
        out=args.out,
        call=call_arguments(args.call),
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
