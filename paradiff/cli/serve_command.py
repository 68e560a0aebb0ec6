"""``paradiff serve``: its options, and turning them into the server's settings (the server is :mod:`paradiff.serve`).

Kept apart from the other commands: the server needs the ``serve`` extra (FastAPI, uvicorn), which the core
install leaves out.
"""

from __future__ import annotations

import argparse
import importlib.util
import math

from ..devices import DTYPES
from ..errors import ParadiffError
from ..launch.quiet import quiet_output
from ..loading import ALLOW_PICKLE_FLAG, DEFAULT_MODEL, MODEL_NAMES, check_model
from ..serve.settings import API_KEY_ENV, Limits, ServeSettings
from .argument_checks import resolve_nproc, resolve_steps, steps_defaults, threads_per_rank

#: Packages only ``paradiff serve`` needs: the ``serve`` extra.
SERVE_PACKAGES = ("fastapi", "uvicorn", "multipart")


def add_serve_parser(commands, formatter_class) -> None:
    limits = Limits()
    parser = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API on N ranks",
        description="Load the model once on N ranks and answer OpenAI-style requests (POST /v1/images/generations, "
        "POST /v1/videos) until stopped (SIGTERM: accepted requests finish, then exit 0). Each request runs "
        "under its own strategy (auto: the fastest exact one for its size and steps, planned once per shape).",
        formatter_class=formatter_class,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(MODEL_NAMES)}, a folder or a hub id")
    parser.add_argument(
        "--nproc",
        type=int,
        help="ranks to start, one per GPU (default: every visible GPU, or 2 on a machine without one; under "
        "torchrun, torchrun's)",
    )
    parser.add_argument("--strategy", default="auto", help="auto, or the strategy every request runs by default")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    parser.add_argument(
        "--api-key",
        help=f"the key every request but GET /health must carry (Authorization: Bearer KEY); default: ${API_KEY_ENV}, "
        "else none",
    )
    parser.add_argument("--max-queue", type=int, default=16, help="requests that may wait; one more is answered 429")
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="SECONDS", help="a request's deadline (504 after)"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="restarts in a row after a lost rank before giving up"
    )
    parser.add_argument(
        "--max-batch", type=int, default=1, help="queued requests of one shape drawn in one call (1: no batching)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"denoising steps of a request that sets none {steps_defaults()}",
    )
    parser.add_argument(
        "--warmup", type=int, default=4, help="warm-up steps of a request that sets none (0 under a fidelity floor)"
    )
    parser.add_argument(
        "--fidelity",
        default="exact",
        choices=("exact", "displaced"),
        help="what auto may pick for a request that does not say: exact strategies only, or all",
    )
    parser.add_argument(
        "--fidelity-floor",
        type=float,
        metavar="DB",
        help="the PSNR floor against one device (e.g. 30) of a request that sets no fidelity_floor_db: a displaced "
        "step whose reused results moved too far runs in sync; the first request of a shape calibrates how far",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="where the ranks run")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="weights and activations (auto: float16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: CPU cores / ranks)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS", help="the longest one rank waits for another"
    )
    parser.add_argument("--max-n", type=int, default=limits.n, help="most pictures per request")
    parser.add_argument("--max-steps", type=int, default=limits.steps, help="most steps per request")
    parser.add_argument("--max-frames", type=int, default=limits.frames, help="most frames per video")
    parser.add_argument("--max-prompt-chars", type=int, default=limits.prompt_chars, help="longest prompt")
    parser.add_argument("--max-size", type=int, default=limits.size, help="longest side of a picture, in pixels")
    parser.add_argument(ALLOW_PICKLE_FLAG, action="store_true", help="also load pickled weights (.bin, .pt)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every rank's output and each request")
    parser.set_defaults(func=serve)


def _require_serve_extra() -> None:
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ParadiffError(
            f"paradiff serve needs {', '.join(missing)}, which the core install leaves out; "
            "pip install 'paradiff[serve]'"
        )


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The server's settings from ``args``, every number checked (``--steps`` the model's own when not given)."""
    args = argparse.Namespace(**{**vars(args), "steps": resolve_steps(args)})
    positive = {
        "max_queue": 0,
        "max_restarts": 0,
        "max_batch": 1,
        "steps": 2,
        "warmup": 0,
        "max_n": 1,
        "max_steps": 2,
        "max_frames": 1,
        "max_prompt_chars": 1,
        "max_size": 8,
    }
    for name, low in positive.items():
        if getattr(args, name) < low:
            raise ParadiffError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    for name in ("request_timeout", "timeout"):
        if not getattr(args, name) > 0:
            raise ParadiffError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if not 0 <= args.port <= 65535:
        raise ParadiffError(f"--port must be from 0 to 65535, got {args.port}")
    if args.fidelity_floor is not None and not 0 < args.fidelity_floor < math.inf:
        raise ParadiffError(f"--fidelity-floor must be a positive number of dB (e.g. 30), got {args.fidelity_floor:g}")
    if args.steps > args.max_steps:
        raise ParadiffError(f"--steps {args.steps} is above --max-steps {args.max_steps}")
    from ..strategies import strategy_names

    if args.strategy != "auto" and args.strategy not in strategy_names():
        raise ParadiffError(f"unknown --strategy {args.strategy!r}; use auto or one of {', '.join(strategy_names())}")
    nproc = resolve_nproc(args)
    limits = Limits(args.max_n, args.max_steps, args.max_frames, args.max_prompt_chars, args.max_size)
    return ServeSettings(
        model=args.model,
        nproc=nproc,
        strategy=args.strategy,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_restarts=args.max_restarts,
        max_batch=args.max_batch,
        steps=args.steps,
        warmup=args.warmup,
        fidelity=args.fidelity,
        fidelity_floor=args.fidelity_floor,
        device=args.device,
        dtype=args.dtype,
        threads=threads_per_rank(args.threads, nproc),
        timeout_s=args.timeout,
        allow_pickle=args.allow_pickle,
        verbose=args.verbose,
        limits=limits,
    )


def serve(args: argparse.Namespace) -> int:
    _require_serve_extra()
    with quiet_output(args.verbose, libraries=False):
        settings = settings_from(args)
        check_model(settings.model)
    from ..serve.main import serve as run_server

    return run_server(settings)
