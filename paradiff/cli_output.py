"""What the ``paradiff`` command shows: third-party noise off unless ``--verbose``, and its summary in words.

Quiet means: Python warnings of other packages ignored (paradiff's own :class:`ParadiffWarning` always
shows), transformers, diffusers, huggingface_hub and the root logger at ERROR, loading bars off, and in
worker processes PyTorch's C++ warnings off. The progress bars of the image itself stay (rank 0's).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import ParadiffWarning

#: Read at import by the libraries (and by PyTorch's C++ side at startup): set for worker processes, and
#: here around an in-process run, so that messages printed while the libraries import stay off too.
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore",
}
#: Loggers set to ERROR (their children inherit it): the libraries' own and the root logger.
QUIET_LOGGERS = ("", "transformers", "diffusers", "huggingface_hub", "torch", "accelerate", "PIL")


def quiet_warnings() -> None:
    """Ignore every Python warning except paradiff's own, which show as one line: ``paradiff: warning: ...``."""
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", category=ParadiffWarning)  # filters added later take precedence
    warnings.showwarning = _show_warning


_PYTHON_SHOWWARNING = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if not issubclass(category, ParadiffWarning):
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)
        return
    stream = file or sys.stderr
    with contextlib.suppress(OSError):  # stderr gone: as Python's own showwarning, say nothing
        print(f"paradiff: warning: {' '.join(str(message).split())}", file=stream, flush=True)


def quiet_libraries() -> None:
    """Loggers to ERROR and the loading bars of diffusers, transformers and huggingface_hub off.

    Imports those libraries' logging modules (diffusers and transformers), so call it where they will be
    imported anyway: in the process that loads the pipeline.
    """
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover - transformers is a dependency, but keep quiet mode working
        pass
    else:
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


@contextmanager
def quiet_output(verbose: bool, libraries: bool = True) -> Iterator[None]:
    """Third-party noise off inside the block (nothing changes with ``verbose``); restored afterwards.

    ``libraries=False`` leaves diffusers and transformers unimported (for a process that only launches
    workers, which quiet themselves).
    """
    if verbose:
        yield
        return
    saved_env = {name: os.environ.get(name) for name in QUIET_ENV}
    saved_levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    saved_bars = _library_bars() if libraries else None
    os.environ.update(QUIET_ENV)
    try:
        with warnings.catch_warnings():
            quiet_warnings()
            if libraries:
                quiet_libraries()
            else:
                for name in QUIET_LOGGERS:
                    logging.getLogger(name).setLevel(logging.ERROR)
            yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
        if saved_bars is not None:
            _restore_library_bars(saved_bars)


def _library_bars() -> dict:
    """Whether each library's loading bars are on now, and the libraries' logger levels, to restore later."""
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import are_progress_bars_disabled

    state = {
        "diffusers": diffusers_logging.is_progress_bar_enabled(),
        "diffusers_level": diffusers_logging.get_verbosity(),
        "hub": not are_progress_bars_disabled(),
    }
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover
        return state
    state.update(transformers=transformers_logging.is_progress_bar_enabled())
    state.update(transformers_level=transformers_logging.get_verbosity())
    return state


def _restore_library_bars(state: dict) -> None:
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import enable_progress_bars

    diffusers_logging.set_verbosity(state["diffusers_level"])
    if state["diffusers"]:
        diffusers_logging.enable_progress_bar()
    if state["hub"]:
        enable_progress_bars()
    if "transformers" in state:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(state["transformers_level"])
        if state["transformers"]:
            transformers_logging.enable_progress_bar()


# --- the summary in words -------------------------------------------------------------------------------


def times_sign() -> str:
    """``×``, or ``x`` where stdout cannot encode it."""
    try:
        "×".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "x"
    return "×"


def format_speedup(speedup: float, times: str = "×") -> str:
    """``"1.8× faster"``, ``"4.0× slower"`` (for 0.25), or ``"as fast as one device"`` within 5%."""
    if not math.isfinite(speedup) or speedup <= 0:
        return "speed not measured"
    if 1 / 1.05 < speedup < 1.05:
        return "as fast as one device"
    if speedup >= 1:
        return f"{speedup:.1f}{times} faster"
    return f"{1 / speedup:.1f}{times} slower"


#: Above this PSNR two images differ by float round-off only (8-bit output differs below about 50 dB).
ROUND_OFF_DB = 100.0


def format_fidelity(psnr_db: float) -> str:
    """How close the image is to one device's: identical, equal within float round-off, or its PSNR."""
    if math.isinf(psnr_db) and psnr_db > 0:
        return "identical to one device"
    if psnr_db >= ROUND_OFF_DB:
        return f"equal to one device within float round-off (PSNR {psnr_db:.0f} dB)"
    return f"PSNR {psnr_db:.1f} dB against one device"


def format_bytes(count: float) -> str:
    """``"512 B"``, ``"26.0 kB"``, ``"470 kB"``, ``"33.4 MB"``, ``"1.2 GB"`` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.1f} {unit}"
    return f"{count:.0f} B"


def summary_lines(report: dict, phase: str, times: str = "×") -> list[str]:
    """The lines ``paradiff generate`` prints after a run: the files, each phase's time, speed, fidelity, traffic.

    ``report`` is rank 0's: ``files``, ``latency_s`` (every call together) and, after the reference runs,
    ``baseline_s``, ``speedup`` and ``psnr_db`` (the lowest over the pictures); after a parallel run
    ``bytes_per_step`` and ``wait_s``; ``peak_memory_mb`` (per rank, of the loading and of the run) and
    ``loaded_by_stage``. ``phase`` names the run (``"one device"`` or ``"2 ranks, patch"``).
    """
    files = report["files"]
    lines = [f"wrote {files[0]}" if len(files) == 1 else f"wrote {len(files)} files: {', '.join(files)}"]
    if "baseline_s" in report:
        lines.append(f"one device: {report['baseline_s']:.2f} s")
    line = f"{phase}: {report['latency_s']:.2f} s"
    if "speedup" in report:
        fidelity = format_fidelity(report["psnr_db"])
        fidelity = fidelity if len(files) == 1 else f"{fidelity} (the least close picture)"
        line += f", {format_speedup(report['speedup'], times)}, {fidelity}"
    lines.append(line)
    if "picked" in report:
        lines.append(f"auto picked {report['picked']}")
    if "bytes_per_step" in report:
        lines.append(
            f"traffic: {format_bytes(report['bytes_per_step'])} per step per rank, "
            f"{report['wait_s']:.2f} s waiting for other ranks"
        )
    peaks = report.get("peak_memory_mb", {})
    if peaks and all(value is not None for values in peaks.values() for value in values):
        by_stage = report.get("loaded_by_stage")
        where = "each rank loaded only its stage of the blocks" if by_stage else "whole model loaded"
        shown = {phase: " / ".join(f"{value:,.0f}" for value in values) for phase, values in peaks.items()}
        lines.append(
            f"peak memory per rank (MB): loading {shown['loading']}, generating {shown['generating']} ({where})"
        )
    return lines


def json_number(value: float | None) -> float | None:
    """A float JSON can hold: None for a missing or non-finite figure (an identical picture's PSNR is ``inf``)."""
    return value if value is not None and math.isfinite(value) else None


def generate_json(report: dict, job) -> dict:
    """``paradiff generate --json``: one object for the run (the files, seconds, speedup, PSNR, traffic, memory).

    A PSNR of ``inf`` (identical to one device) is written as null beside ``"identical": true``.
    """
    pictures = [
        {**picture, "psnr_db": json_number(picture.get("psnr_db")), "identical": picture.get("psnr_db") == math.inf}
        for picture in report["pictures"]
    ]
    return {
        "files": report["files"],
        "model": job.model,
        "strategy": job.strategy,
        "nproc": job.nproc,
        "steps": job.steps,
        "seconds": report["latency_s"],
        "one_device_seconds": report.get("baseline_s"),
        "speedup": json_number(report.get("speedup")),
        "psnr_db": json_number(report.get("psnr_db")),
        "identical": report.get("psnr_db") == math.inf,
        "bytes_per_step": report.get("bytes_per_step"),
        "wait_s": report.get("wait_s"),
        "peak_memory_mb": report.get("peak_memory_mb"),
        "loaded_by_stage": report.get("loaded_by_stage"),
        "picked": report.get("picked"),
        "pictures": pictures,
    }
