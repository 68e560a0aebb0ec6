"""The paradiff command line: generate, bench, plan and serve on N ranks.

Commands:
  generate   draw an image or a video on N ranks, beside the same picture from one device
  bench      time and score every strategy and warm-up against one device; writes a report
  plan       predict which strategy pays on a model, size and machine, before running anything
  serve      keep the model loaded on N ranks and answer an OpenAI-compatible HTTP API

Exit status: 0 done; 2 bad input (one line on stderr, found before anything is drawn); 1 any other
failure (one line on stderr naming the log that holds the tracebacks); 130 interrupted (Ctrl-C);
143 terminated (SIGTERM). No worker process is left behind in any case.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import signal
import sys
import tempfile
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from .. import __version__
from ..caches import CACHE_NAMES
from ..devices import DTYPES
from ..errors import ParadiffError, PeerFailure
from ..launch import RanksFailed, run_on_ranks, under_torchrun
from ..launch.quiet import quiet_output
from ..loading import (
    ALLOW_PICKLE_FLAG,
    DEFAULT_MODEL,
    MODEL_NAMES,
    call_arguments,
    check_model,
    default_size,
    default_strategy,
)
from ..plan.architectures import architecture_names
from ..plan.hardware import hardware_names
from ..strategies import strategy_names
from .argument_checks import (
    check_numbers,
    given_prompts,
    named_defaults,
    resolve_nproc,
    resolve_steps,
    seed_value,
    steps_defaults,
    threads_per_rank,
)
from .generate_job import GenerateJob, check_outputs, generate_on_rank
from .serve_command import add_serve_parser
from .summary import generate_json, summary_lines, times_sign

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every ``finally`` (the workers' cleanup) runs."""


def _in_process(nproc: int) -> bool:
    """Whether the ranks' function runs in this process (one rank, or torchrun's rank)."""
    return nproc == 1 or under_torchrun()


def generate(args: argparse.Namespace) -> int:
    check_numbers(args)
    prompts = given_prompts(args, args.prompt)
    if not prompts:
        raise ParadiffError('say what to draw: paradiff generate "a prompt" (or --prompt, --prompts-file)')
    nproc = resolve_nproc(args)
    strategy = args.strategy or default_strategy(args.model)
    job = GenerateJob(
        prompts=tuple(prompts),
        model=args.model,
        strategy=strategy,
        nproc=nproc,
        steps=resolve_steps(args),
        size=args.size or default_size(args.model),
        width=args.width,
        frames=args.frames,
        seed=args.seed,
        warmup=args.warmup,
        fidelity_floor=args.fidelity_floor,
        out=args.out,
        baseline=not args.no_baseline,
        threads=threads_per_rank(args.threads, nproc),
        device=args.device,
        dtype=args.dtype,
        guidance=args.guidance,
        negative_prompt=args.negative_prompt,
        allow_pickle=args.allow_pickle,
        call=call_arguments(args.call),
        overwrite=args.overwrite,
        timeout_s=args.timeout,
    )
    check_outputs(job)
    with quiet_output(args.verbose, libraries=False):
        check_model(job.model)  # the world size is the ranks' to check: they import the strategy anyway
    with quiet_output(args.verbose, libraries=_in_process(job.nproc)):
        report = run_on_ranks(
            generate_on_rank, job.nproc, job, device=job.device, verbose=args.verbose, timeout=_timeout(args)
        )
    if report:
        text = (
            json.dumps(generate_json(report, job), indent=2)
            if args.json
            else "\n".join(summary_lines(report, job.phase, times_sign()))
        )
        print(text, flush=True)
    return 0


def _timeout(args: argparse.Namespace) -> timedelta:
    return timedelta(seconds=args.timeout)


#: Packages only ``paradiff bench`` needs (its figures and fidelity metrics): the ``bench`` extra.
BENCH_PACKAGES = ("matplotlib", "torchmetrics")


def _require_bench_extra() -> None:
    missing = [name for name in BENCH_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ParadiffError(
            f"paradiff bench needs {', '.join(missing)}, which the core install leaves out; "
            "pip install 'paradiff[bench]'"
        )
    try:
        import torchmetrics.functional.image  # noqa: F401
    except Exception as error:  # PyPI's torchvision (a CUDA build) beside a CPU torch breaks this import
        raise ParadiffError(
            f"paradiff bench cannot import torchmetrics' image metrics ({_one_line(error)}); a torchvision not "
            "built for this torch breaks them: uninstall it, or install the build made for this torch"
        ) from error


def bench(args: argparse.Namespace) -> int:
    """One device, then every strategy × warm-up on N ranks, same prompts and seeds; writes a report."""
    _require_bench_extra()
    from .bench_options import job_from_args

    with quiet_output(args.verbose, libraries=False):
        job = job_from_args(args, threads=args.threads)
    from ..bench.run import bench_on_rank

    with quiet_output(args.verbose, libraries=_in_process(job.nproc)):
        results = run_on_ranks(
            bench_on_rank, job.nproc, job, device=job.device, verbose=args.verbose, timeout=_timeout(args)
        )
    if results is not None:
        import json

        from ..bench.report import summary_json, write_report_files

        written = write_report_files(job, results)
        print(json.dumps(summary_json(written), indent=2) if args.json else "\n".join(written.lines), flush=True)
    return 0


def plan(args: argparse.Namespace) -> int:
    """Predict every strategy on the model (traced, and timed here without --hardware); print a table or JSON."""
    import json

    from ..plan.job import PlanJob
    from .bench_options import comma_list, warmup_setting

    check_numbers(args)
    nproc = resolve_nproc(args)
    if nproc < 2:
        raise ParadiffError("a plan compares N ranks with one device; use --nproc 2 or more")
    job = PlanJob(
        model=args.model,
        nproc=nproc,
        steps=resolve_steps(args),
        size=args.size or default_size(args.model),
        width=args.width,
        frames=args.frames,
        strategies=None if args.strategies is None else comma_list(args.strategies, "--strategies"),
        warmups=tuple(warmup_setting(item) for item in comma_list(args.warmup, "--warmup")),
        hardware=args.hardware,
        device=args.device,
        dtype=args.dtype,
        threads=threads_per_rank(args.threads, nproc),
        allow_pickle=args.allow_pickle,
        call=call_arguments(args.call),
        timeout_s=args.timeout,
    )
    with quiet_output(args.verbose, libraries=False):
        result = _make_plan(job, args.verbose)
    if result is not None:
        from ..plan.printout import plan_json, plan_lines

        print(json.dumps(plan_json(result), indent=2) if args.json else "\n".join(plan_lines(result)), flush=True)
    return 0


def _make_plan(job, verbose: bool):
    from ..plan.architectures import architecture_names
    from ..plan.job import plan_architecture
    from ..plan.on_ranks import plan_on_rank

    if job.model in architecture_names():
        return plan_architecture(job)
    check_model(job.model)
    ranks = job.nproc if job.hardware is None else 1  # with --hardware, traced in this process but not timed
    with quiet_output(verbose, libraries=_in_process(ranks)):
        timeout = timedelta(seconds=job.timeout_s)
        return run_on_ranks(plan_on_rank, ranks, job, device=job.device, verbose=verbose, timeout=timeout)


# --- the parser ---------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``paradiff generate: error: ... (see --help)``."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after every option that has a default, except flags and what the help explains."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _version() -> str:
    versions = []
    for package in ("torch", "diffusers"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"paradiff {__version__} ({', '.join(versions)})"


def _add_common(parser: argparse.ArgumentParser, architectures: bool = False) -> None:
    names = (*MODEL_NAMES, *architecture_names()) if architectures else MODEL_NAMES
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(names)}, a folder or a hub id")
    parser.add_argument(
        "--nproc",
        type=int,
        help="how many processes (ranks) to start, one per GPU (default: every visible GPU, or 2 on a machine "
        "without one; under torchrun, torchrun's)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"denoising steps {steps_defaults()}",
    )
    size_defaults = named_defaults(default_size, "the model's own otherwise")
    parser.add_argument("--size", type=int, help=f"height and width in pixels {size_defaults}")
    parser.add_argument("--width", type=int, help="width in pixels, when it differs from the height (default: --size)")
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of the initial noise")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default, or 0: CPU cores / ranks)")
    parser.add_argument(
        "--call",
        action="append",
        metavar="KEY=VALUE",
        help="another argument of the pipeline's call, e.g. --call causal_block_size=5 (VALUE read as JSON: numbers, "
        "true, lists; else a string); repeatable",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the longest one rank waits for another before the run ends with an error (a rank that shows no "
        "sign of life at all ends it within seconds)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show third-party warnings and logs, and every rank's output"
    )


def _add_workload(parser: argparse.ArgumentParser) -> None:
    """What the pictures are drawn with, beyond size and steps: shared by ``generate`` and ``bench``."""
    parser.add_argument(
        "--guidance",
        type=float,
        help="classifier-free guidance scale (default: 2 for the built-in models, the pipeline's own otherwise)",
    )
    parser.add_argument("--negative-prompt", help="what the picture should not show")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="where every rank and the one-device reference run (default: auto, CUDA when present, one GPU per rank)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="weights and activations (default: auto, float16 on CUDA, float32 on the CPU)",
    )


def _add_prompts(parser: argparse.ArgumentParser) -> None:
    """``--prompt`` (repeatable) and ``--prompts-file``; read back with :func:`given_prompts`."""
    parser.add_argument(
        "--prompt", action="append", dest="prompt_options", metavar="TEXT", help="a prompt to draw; repeatable"
    )
    parser.add_argument("--prompts-file", metavar="FILE", help="a text file of prompts, one per line")


def _add_json(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paradiff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser(
        "generate",
        help="generate an image or video on N ranks and compare it with one device",
        description="Generate an image or video on N ranks; first, on rank 0, the same image on one device "
        "(same device and dtype), to report the speedup and the difference.",
        formatter_class=_HelpFormatter,
    )
    gen.add_argument(
        "prompt", nargs="*", help="what to draw (several prompts: several pictures; see also --prompt, --prompts-file)"
    )
    _add_common(gen)
    _add_prompts(gen)
    gen.add_argument(
        "--strategy",
        choices=(*strategy_names(), "auto"),
        help="how the ranks share the work (default: cfg for the built-in models, patch otherwise); auto: the "
        "fastest exact one the first call predicts on this machine",
    )
    gen.add_argument(
        "--warmup",
        type=int,
        help="steps after the first that run fully in sync, before the ranks start reusing each other's results "
        "from the step before (faster, slightly different picture); at least --steps: the exact picture "
        "(default 4; 0 with --fidelity-floor)",
    )
    gen.add_argument(
        "--fidelity-floor",
        type=float,
        metavar="DB",
        help="hold the picture within this PSNR of one device's (e.g. 30): a step whose reused results moved too "
        "far runs in sync; the first run of a size calibrates how far is too far on its prompt and keeps it for later "
        "runs (other prompts can cost more)",
    )
    gen.add_argument("--frames", type=int, help="frames, for video pipelines (default: the model's own)")
    _add_workload(gen)
    gen.add_argument(
        "--out",
        help=f"image ({', '.join(('.png', '.jpg', '.webp'))}, ...) or video (.mp4, .gif) file; with several "
        "pictures, numbered files beside it (picture-1.png, ...) or a folder (default: paradiff.png, or paradiff.mp4 "
        "for video models)",
    )
    gen.add_argument("--overwrite", action="store_true", help="replace output files that already exist")
    _add_json(gen, "the run's files, seconds, speedup, PSNR, traffic and memory")
    gen.add_argument("--no-baseline", action="store_true", help="skip the one-device reference run")
    gen.add_argument(
        ALLOW_PICKLE_FLAG,
        action="store_true",
        help="also load pickled weights (.bin, .pt), which can run code: only from a source you trust "
        "(by default only safetensors load)",
    )
    gen.set_defaults(func=generate)
    ben = commands.add_parser(
        "bench",
        help="one device vs each strategy and warm-up: speed, fidelity, report",
        description="One device, then every strategy and warm-up on N ranks, on the same prompts and seeds; "
        "writes report.html, report.md, results.json and image grids.",
        formatter_class=_HelpFormatter,
    )
    _add_common(ben)
    ben.add_argument("--strategies", default="patch", help=f"comma list of {', '.join(strategy_names())}")
    ben.add_argument(
        "--warmup", default="1,4", help="comma list of warm-up settings (synchronous steps after the first)"
    )
    ben.add_argument(
        "--fidelity-floor",
        metavar="DB[,DB...]",
        help="also run each displaced strategy under the staleness guard at these PSNR floors (comma list, e.g. "
        "30,40), beside the fixed warm-ups",
    )
    ben.add_argument(
        "--prompts",
        type=int,
        help="how many built-in scenes to draw when no --prompt or --prompts-file is given (default: 4); "
        "prompt i uses seed + i",
    )
    ben.add_argument(
        "--cache",
        action="append",
        metavar="NAME[:SETTINGS]",
        help=f"also run with a diffusers step cache on the denoiser, on one device and under every strategy and "
        f"warm-up (repeatable): {', '.join(CACHE_NAMES)}, optionally with fields of its diffusers config as a JSON "
        "object, e.g. 'first-block:{\"threshold\": 0.1}'",
    )
    _add_prompts(ben)
    _add_workload(ben)
    ben.add_argument("--out", default="paradiff-bench", help="folder for results.json, report.md/html and images")
    _add_json(ben, "the report's files and, per run, latency, speedup, fidelity and traffic")
    ben.set_defaults(func=bench)
    pla = commands.add_parser(
        "plan",
        help="predict each strategy's speedup on a model, size and machine before running it",
        description="Predict, per strategy and warm-up, the time per step, the speedup over one device, the bytes "
        "moved and the memory per rank. The model is traced from its own call and, without --hardware, timed "
        "on this machine's ranks (seconds); an architecture name (e.g. sdxl, flux-dev) needs --hardware.",
        formatter_class=_HelpFormatter,
    )
    _add_common(pla, architectures=True)
    pla.add_argument("--frames", type=int, help="frames, for video models (default: the model's own)")
    pla.add_argument("--strategies", help="comma list of strategies to predict (default: every one that runs)")
    pla.add_argument("--warmup", default="4", help="comma list of warm-up settings")
    pla.add_argument("--hardware", choices=hardware_names(), help="a GPU server's published figures instead of timing")
    pla.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="where the ranks time the model")
    pla.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="weights and activations")
    _add_json(pla, "the plan (the machine, every prediction, the fastest and what to run)")
    pla.add_argument(ALLOW_PICKLE_FLAG, action="store_true", help="also load pickled weights (.bin, .pt)")
    pla.set_defaults(func=plan)
    add_serve_parser(commands, _HelpFormatter)
    return parser


# --- errors, interrupts, exit status ------------------------------------------------------------------


def _say(text: str, after_bars: bool = False) -> None:
    """One line on stderr; ``after_bars``: on a new line, where a progress bar may have been cut short."""
    start = "\n" if after_bars and sys.stderr.isatty() else ""
    print(f"{start}paradiff: {' '.join(text.split())}", file=sys.stderr, flush=True)


def _write_log(text: str) -> Path:
    fd, name = tempfile.mkstemp(prefix="paradiff-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        log.write(text)
    return Path(name)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


@contextmanager
def _sigterm_raises():
    """SIGTERM raises :class:`_Terminated` in the block (main thread only), so cleanup runs as for Ctrl-C."""

    def terminated(signum, frame):
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, terminated)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _sigterm_raises():
        try:
            return args.func(args)
        except PeerFailure as error:  # under torchrun: another rank died or froze mid-run
            _say(f"error: {error}", after_bars=True)
            return EXIT_FAILED
        except ParadiffError as error:
            _say(f"error: {error}")
            return EXIT_BAD_INPUT
        except RanksFailed as error:
            _say(f"error: {error} (details in {error.log})", after_bars=True)
            return EXIT_FAILED
        except KeyboardInterrupt:
            _say("interrupted", after_bars=True)
            return EXIT_INTERRUPTED
        except _Terminated:
            _say("terminated", after_bars=True)
            return EXIT_TERMINATED
        except Exception as error:
            log = _write_log(traceback.format_exc())
            _say(f"error: {_one_line(error)} (traceback in {log})", after_bars=True)
            return EXIT_FAILED
