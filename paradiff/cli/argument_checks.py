"""The command line's checks that need no model: run in the parent, before any worker starts.

A value the parser accepts can still be one no run can use (a guidance of ``inf``, a seed torch cannot
take, more ranks than the machine can hold). Each is refused here in one line (exit status 2), so that no worker
is started, and no model loaded, for a run that cannot work. A world the strategy cannot split is refused by the
ranks, before they load the model: the strategies' modules import diffusers, which this process does not.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import ParadiffError
from ..launch import under_torchrun
from ..loading import DEFAULT_STEPS, TRAINED_MODELS, default_steps

#: The largest seed ``torch.Generator.manual_seed`` takes (it reads the seed as an unsigned 64-bit integer).
MAX_SEED = 2**64 - 1
#: CPU ranks per core beyond which a run only queues for the cores (and each rank holds a copy of the model).
CPU_RANKS_PER_CORE = 2


def check_numbers(args: argparse.Namespace) -> None:
    """Counts, sizes, guidance, seed and timeout that no run can use."""
    at_least = {"nproc": 1, "steps": 1, "frames": 1, "warmup": 0, "threads": 0}
    for option, low in at_least.items():
        value = getattr(args, option, None)
        if isinstance(value, int) and value < low:  # bench and plan take --warmup as a list
            raise ParadiffError(f"--{option} must be at least {low}, got {value}")
    for option in ("size", "width"):
        value = getattr(args, option, None)
        if value is not None and (value < 8 or value % 8):
            raise ParadiffError(f"--{option} must be a positive multiple of 8, got {value}")
    guidance = getattr(args, "guidance", None)
    if guidance is not None and not math.isfinite(guidance):
        raise ParadiffError(f"--guidance must be a finite number, got {guidance:g}")
    if guidance is not None and guidance < 0:
        raise ParadiffError(f"--guidance must be 0 or more, got {guidance:g}")
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ParadiffError(f"--seed must be an integer from 0 to 2**64 - 1, got {seed}")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ParadiffError(f"--timeout must be a positive number of seconds, got {timeout:g}")


def resolve_steps(args: argparse.Namespace) -> int:
    """``--steps``, or the model's own when none is given (:func:`paradiff.loading.default_steps`)."""
    return default_steps(args.model) if args.steps is None else args.steps


def named_defaults(default: Callable[[str], int | None], otherwise: str, unless: int | None = None) -> str:
    """``(default: 8 for paradiff-tiny-video, 20 otherwise)``: an option's value for each built-in model (but the
    models whose value is ``unless``), from the function that gives it, then ``otherwise``."""
    models: dict[int | None, list[str]] = {}
    for model in TRAINED_MODELS:
        value = default(model)
        if value != unless:
            models.setdefault(value, []).append(model)
    named = [f"{value} for {' and '.join(names)}" for value, names in models.items()]
    return f"(default: {', '.join([*named, otherwise])})"


def steps_defaults() -> str:
    """``--steps``' defaults for its help: the built-in models' own, then :data:`~paradiff.loading.DEFAULT_STEPS`."""
    return named_defaults(default_steps, f"{DEFAULT_STEPS} otherwise", unless=DEFAULT_STEPS)


def seed_value(text: str) -> int:
    """``--seed``'s type: an integer, also when written as ``1e3`` (a float that is a whole number)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: pass an integer") from None
    if not (math.isfinite(value) and value.is_integer()):
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: pass an integer")
    return int(value)


#: Files a GPU driver makes on Linux (NVIDIA's, ROCm's, WSL's): without any of them torch sees no GPU, so the
#: launcher's parent need not import torch (seconds) to learn it.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus(device: str) -> int:
    """GPUs the ranks would use: none for ``--device cpu``, else those torch sees."""
    if device == "cpu" or sys.platform == "linux" and not any(map(os.path.exists, GPU_DEVICE_FILES)):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(args: argparse.Namespace) -> int:
    """The world size of this run: torchrun's under torchrun, else ``--nproc`` or the machine's default.

    The default is one rank per visible GPU, or 2 on a machine without one. More ranks than the machine
    can hold are refused: one per GPU under NCCL, :data:`CPU_RANKS_PER_CORE` per core otherwise. A plan for another
    machine (``--hardware``) takes ``--nproc`` as asked, under torchrun too: it is that machine's rank count.
    """
    for_another_machine = getattr(args, "hardware", None) is not None
    if under_torchrun() and not (for_another_machine and args.nproc is not None):
        return int(os.environ["WORLD_SIZE"])
    device = getattr(args, "device", "auto")
    gpus = visible_gpus(device)
    nproc = args.nproc if args.nproc is not None else (gpus or 2)
    if nproc < 1:
        raise ParadiffError(f"--nproc must be at least 1, got {nproc}")
    if for_another_machine:  # starts no rank here
        return nproc
    if gpus and os.environ.get("PARADIFF_BACKEND", "auto") != "gloo":
        if nproc > gpus:
            raise ParadiffError(
                f"--nproc {nproc}: NCCL runs one rank per GPU and torch sees {gpus}; use --nproc {gpus} or fewer, "
                "share the GPUs through gloo (PARADIFF_BACKEND=gloo), or run on the CPU (--device cpu)"
            )
        return nproc
    cores = os.cpu_count() or 1
    most = max(2, CPU_RANKS_PER_CORE * cores)
    if nproc > most:
        raise ParadiffError(
            f"--nproc {nproc}: this machine has {cores} CPU core{'s' if cores > 1 else ''}, and every rank loads "
            f"the model and needs a core to gain; use --nproc {min(cores, most) if cores > 1 else 2} (at most {most})"
        )
    return nproc


def threads_per_rank(threads: int | None, nproc: int) -> int:
    """``--threads``, or by default (None or 0) the CPU cores shared out among the ranks."""
    return threads or max(1, (os.cpu_count() or 1) // max(nproc, 1))


def given_prompts(args: argparse.Namespace, positional: list[str] | None = None) -> list[str]:
    """The prompts of a run, in order: the positional ones, each ``--prompt``, then the lines of ``--prompts-file``.

    Blank lines of the file are skipped; an empty prompt or an unreadable or empty file is refused.
    """
    prompts = [*(positional or []), *(getattr(args, "prompt_options", None) or [])]
    if any(not prompt.strip() for prompt in prompts):
        raise ParadiffError("a prompt is empty; say what to draw")
    name = getattr(args, "prompts_file", None)
    if name is not None:
        path = Path(name).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise ParadiffError(f"cannot read --prompts-file {name}: {reason}") from error
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise ParadiffError(f"--prompts-file {name} holds no prompt (one per line)")
        prompts += from_file
    return prompts
