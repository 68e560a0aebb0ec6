"""The settings of one ``paradiff bench`` (built from its options by :mod:`paradiff.cli.bench_options`) and its runs."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from ..strategies import strategy_class
from .prompts import bench_prompts

#: How many built-in scenes bench draws when neither ``--prompts`` nor ``--prompt``/``--prompts-file`` is given.
DEFAULT_PROMPTS = 4


@dataclass(frozen=True)
class RunSpec:
    """One row of the report: one device (no strategy) or one strategy at one warm-up or fidelity floor, with a step
    cache or not."""

    strategy: str | None = None
    warmup: int | None = None
    #: A step cache on the denoiser (``--cache``: ``NAME`` or ``NAME:{settings}``); None: none.
    cache: str | None = None
    #: The staleness guard's PSNR floor in dB (``--fidelity-floor``), in place of a fixed warm-up; None: none.
    floor: float | None = None

    @property
    def label(self) -> str:
        if self.strategy is None:
            run = "one device"
        elif self.floor is not None:
            run = f"{self.strategy} floor={self.floor:g} dB"
        else:
            run = self.strategy if self.warmup is None else f"{self.strategy} warmup={self.warmup}"
        return run if self.cache is None else f"{self.cache.partition(':')[0]} cache, {run}"

    @property
    def options(self) -> dict:
        """What ``parallelize`` takes of the run's warm-up or floor (its default where it sets neither)."""
        if self.floor is not None:
            return {"fidelity_floor_db": self.floor}
        return {} if self.warmup is None else {"warmup_steps": self.warmup}


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
    #: Step caches (``--cache``), each run on one device and under every strategy and warm-up.
    caches: tuple[str, ...] = ()
    #: Fidelity floors in dB (``--fidelity-floor``): each displaced strategy also runs under the staleness guard.
    floors: tuple[float, ...] = ()

    def prompt_list(self, video: bool = False) -> list[str]:
        """The prompts every run draws: the user's, or ``prompts`` built-in scenes (moving ones for video)."""
        return list(self.prompt_texts) if self.prompt_texts else bench_prompts(self.prompts, video=video)

    def runs(self) -> list[RunSpec]:
        """The baseline first, then every strategy × warm-up in the order given (once for exact strategies) and each
        displaced strategy × fidelity floor, then each cache on one device and under all of those."""
        runs = [ONE_DEVICE]
        for cache in (None, *self.caches):
            if cache is not None:
                runs.append(RunSpec(cache=cache))
            for strategy in self.strategies:
                displaced = strategy_class(strategy).uses_warmup
                runs += [RunSpec(strategy, warmup, cache) for warmup in (self.warmups if displaced else (None,))]
                runs += [RunSpec(strategy, cache=cache, floor=floor) for floor in (self.floors if displaced else ())]
        return runs

    def command(self) -> str:
        """The command line that reproduces this job, every option spelled out."""
        options = {
            "--model": self.model,
            "--strategies": ",".join(self.strategies),
            "--warmup": ",".join(map(str, self.warmups)),
            "--fidelity-floor": ",".join(f"{floor:g}" for floor in self.floors) or None,
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
        prompts += [part for cache in self.caches for part in ("--cache", cache)]
        calls = [part for key, value in self.call for part in ("--call", f"{key}={json.dumps(value)}")]
        parts = [str(part) for item in given.items() for part in item]
        return shlex.join(["paradiff", "bench", *parts, *prompts, *calls])
