"""One worker of :func:`paradiff.launch.run_on_ranks` (run as ``python -m paradiff.launch.worker``).

It reads two length-prefixed pickles from stdin (its settings, then the function and its arguments),
joins the process group through the parent's ``FileStore``, runs the function, waits at a barrier for
the other ranks, and writes one length-prefixed pickle to the file descriptor ``PARADIFF_RESULT_FD``
names: ``("ok", value)``, ``("paradiff", message)`` for a :class:`ParadiffError`, or ``("error", line)``
for anything else (whose traceback it appends to the log). After a failure it does not exit but waits
for the parent to stop every rank. stdin stays open while the parent lives; at its end the worker kills
its own process group (itself and anything it started).
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from datetime import timedelta

from . import BEAT_FD_ENV, BEAT_S, RESULT_FD_ENV


def _read_part(stream) -> bytes:
    (size,) = struct.unpack("<Q", _read_exactly(stream, 8))
    return _read_exactly(stream, size)


def _read_exactly(stream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            os._exit(3)  # the parent went away before sending everything
        data += chunk
    return data


def _watch_parent(stream) -> None:
    """Block until stdin ends (the parent exited or is done with us), then kill this process group."""
    try:
        while stream.read(1 << 16):
            pass
    except (OSError, ValueError):
        pass
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _beat(beat_fd: int, every_s: float) -> None:
    """Write one byte every ``every_s`` seconds: the parent's sign that this process still runs."""
    while True:
        try:
            os.write(beat_fd, b".")
        except OSError:  # the parent is gone; _watch_parent ends this process
            return
        time.sleep(every_s)


def _send(result_fd: int, message: tuple) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as error:  # an unpicklable result
        data = pickle.dumps(("error", f"its result cannot be sent back: {type(error).__name__}: {error}"))
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        written = os.write(result_fd, view)
        view = view[written:]
    os.close(result_fd)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _alias_main(main: tuple[str, str] | None) -> None:
    """Make the parent's ``__main__`` importable as ``__main__`` here, for what the payload defines there.

    As ``multiprocessing``'s spawn does: the module of ``python -m module`` is imported under its own
    name, a script is run as ``__mp_main__`` (so its ``if __name__ == "__main__":`` block does not run).
    """
    if main is None:
        return
    import importlib
    import runpy
    import types

    kind, name = main
    if kind == "module":
        module = importlib.import_module(name)
    else:
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(runpy.run_path(name, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _join_group(settings: dict) -> None:
    """The default process group over every worker: NCCL on CUDA (this rank's GPU), gloo on CPU, or gloo on
    CUDA with ``PARADIFF_BACKEND=gloo`` (ranks then share the GPUs there are)."""
    import torch
    import torch.distributed as dist

    from ..errors import ParadiffError
    from ..runtime.distributed import backend_for, local_device

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=settings["timeout_s"])
    store = dist.FileStore(settings["store"], world_size)
    cuda = settings["device"] != "cpu" and torch.cuda.is_available()
    if settings["device"] == "cuda" and not cuda:
        raise ParadiffError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    device = local_device() if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if backend_for(device) == "gloo":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    if world_size > torch.cuda.device_count():
        raise ParadiffError(
            f"{world_size} ranks on CUDA need one GPU each with NCCL, and torch sees {torch.cuda.device_count()}; "
            f"start at most {torch.cuda.device_count()} ranks (--nproc), share the GPUs through gloo "
            "(PARADIFF_BACKEND=gloo), or run on the CPU (--device cpu)"
        )
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops every worker
    result_fd = int(os.environ.pop(RESULT_FD_ENV))
    beat_fd = int(os.environ.pop(BEAT_FD_ENV))
    threading.Thread(target=_beat, args=(beat_fd, BEAT_S), daemon=True, name="paradiff-beat").start()
    stdin = sys.stdin.buffer
    settings = pickle.loads(_read_part(stdin))
    sys.path[:] = settings["sys_path"]
    payload = _read_part(stdin)
    threading.Thread(target=_watch_parent, args=(stdin,), daemon=True).start()
    if not settings["verbose"]:
        from .quiet import quiet_warnings

        quiet_warnings()

    from ..errors import ParadiffError, PeerFailure

    rank = os.environ.get("RANK", "?")
    try:
        if not settings["verbose"]:
            from .quiet import quiet_libraries

            quiet_libraries()
        _alias_main(settings["main"])
        fn, args = pickle.loads(payload)
        _join_group(settings)
        value = fn(*args)
        import torch.distributed as dist

        dist.barrier()  # no rank leaves while another may still exchange with it
        message = ("ok", value)
    except BaseException as error:
        # bad input is a ParadiffError; a PeerFailure (another rank died or froze mid-run) is not
        if isinstance(error, ParadiffError) and not isinstance(error, PeerFailure):
            message = ("paradiff", str(error))
        else:
            with open(settings["log"], "a") as log:
                log.write(f"--- rank {rank} (pid {os.getpid()}) ---\n{traceback.format_exc()}\n")
            message = ("error", _one_line(error))
    sys.stdout.flush()
    sys.stderr.flush()
    _send(result_fd, message)
    if message[0] != "ok":
        # Stay until the parent stops every rank: exiting now would break the others' collectives, and
        # their "connection closed" errors would race this rank's own report to the parent.
        threading.Event().wait()
    os._exit(0)


if __name__ == "__main__":
    main()
