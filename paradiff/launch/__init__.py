"""Run a function on N local ranks: worker processes of paradiff's own, or the ranks torchrun made.

Why not torch's elastic launcher: its c10d rendezvous store (a ``TCPStore``) listens on every interface
(``*:port``) whatever host it is given, and a failed or interrupted job ends with every rank's traceback
after its agent's shutdown. Here the ranks meet through a :class:`torch.distributed.FileStore` in a
private temporary folder (no socket at all), gloo and NCCL are pinned to the loopback interface
(``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless already set), and the parent watches every
worker:

* a :class:`ParadiffError` on any rank comes back as a :class:`ParadiffError` here;
* any other exception, or a worker that dies, stops every other worker at once and raises
  :class:`RanksFailed`, whose message is one line and whose ``log`` holds the tracebacks;
* a worker that shows no sign of life for :data:`SILENT_S` seconds (stopped, or stuck where even its
  heartbeat thread cannot run) counts as failed in the same way: every worker writes a byte to a pipe
  of its own every :data:`BEAT_S` seconds, from a thread, whatever its main thread is doing. A worker
  whose CPU time grows is alive too (Linux): on a loaded host a long call that holds the interpreter
  lock (an import, a C extension) can keep the heartbeat thread from running for seconds;
* an interrupt (Ctrl-C) or any exception in the parent kills every worker before it propagates.

Each worker is the leader of a session of its own (``start_new_session``): the terminal's Ctrl-C reaches
only the parent, which then kills each worker's whole process group (the worker and anything it
started). A worker whose parent dies kills its own group too (it watches its stdin, which only the
parent holds open).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..errors import ParadiffError

#: The module each worker runs (``python -m``).
WORKER_MODULE = "paradiff.launch.worker"
#: The longest one rank waits for another in a collective of the default group.
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: After the first failure, how long the parent waits for the other ranks' own reports before stopping them
#: (so that the rank that died is reported, not the neighbour whose collective broke because of it).
FAILURE_GRACE_S = 1.0
#: How long finished workers get to exit on their own before their process groups are killed.
EXIT_GRACE_S = 10.0
#: The environment variable that tells a worker which file descriptor carries its result to the parent.
RESULT_FD_ENV = "PARADIFF_RESULT_FD"
#: The environment variable naming the file descriptor a worker beats on.
BEAT_FD_ENV = "PARADIFF_BEAT_FD"
#: Seconds between two beats of a worker.
BEAT_S = 0.5
#: Seconds without a beat after which a worker counts as lost: several beats, so a busy host does not make a
#: live worker look silent.
SILENT_S = 5.0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def ranks_to_use(nproc: int) -> int:
    """The world size a job will have: torchrun's when under it, else ``nproc``."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc


class RanksFailed(RuntimeError):
    """A rank raised something other than a :class:`ParadiffError`, or died; every other rank was stopped.

    ``str(error)`` is one line naming the rank and what happened; ``log`` is the file holding the
    tracebacks (and, unless verbose, every rank but rank 0's output).
    """

    def __init__(self, message: str, log: Path):
        super().__init__(message)
        self.log = log


def loopback_ifname() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), or None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((name for name in names if name.startswith("lo")), None)


def run_on_ranks(
    fn: Callable,
    nproc: int,
    *args,
    device: str = "auto",
    verbose: bool = False,
    timeout: timedelta = DEFAULT_TIMEOUT,
    spawn_always: bool = False,
):
    """``fn(*args)`` on every rank; returns rank 0's result.

    Under ``torchrun`` (or any launcher that set ``RANK``/``WORLD_SIZE``), or with ``nproc == 1``, this
    process is the only rank here and ``fn`` runs in it. Otherwise ``nproc`` worker processes run ``fn``
    in a process group made before ``fn`` starts: NCCL on CUDA (one GPU per rank, ``LOCAL_RANK``), gloo
    on CPU. ``device`` is ``"auto"`` (CUDA when present), ``"cuda"`` or ``"cpu"`` (the workers then see
    no GPU). ``fn`` must be importable by name (a module-level function), and ``args`` and its result
    picklable. Unless ``verbose``, workers silence third-party warnings and logs, and ranks other than 0
    write their output to the log rather than to this process's stdout and stderr.

    Raises the first rank's :class:`ParadiffError` as a :class:`ParadiffError`, and :class:`RanksFailed`
    when a rank raised anything else or died; no worker outlives this call. ``spawn_always`` starts a worker
    for one rank too (a server's front must outlive its ranks).
    """
    if under_torchrun() or nproc == 1 and not spawn_always:
        return fn(*args)
    if device not in ("auto", "cuda", "cpu"):
        raise ParadiffError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    payload = pickle.dumps((fn, args))  # before any process starts: an unpicklable argument fails here
    with _Workers(nproc, device, verbose, timeout) as workers:
        return workers.run(payload)


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    result_fd: int
    received: bytearray
    beat_fd: int
    last_beat: float
    result: tuple | None = None  # ("ok", value) | ("paradiff", message) | ("error", line)
    closed: bool = False
    beat_closed: bool = False
    #: The worker's CPU seconds when last read, and when they last grew (``silent_s``).
    cpu_s: float | None = None
    last_progress: float = 0.0

    def silent_s(self, now: float) -> float:
        """Seconds since the worker last beat or used CPU time, whichever is later; 0 once it closed its beat pipe
        (it is exiting)."""
        if self.beat_closed:
            return 0.0
        cpu = cpu_seconds(self.process.pid)
        if cpu is not None and (self.cpu_s is None or cpu > self.cpu_s):
            self.cpu_s, self.last_progress = cpu, now
        return now - max(self.last_beat, self.last_progress)


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (user + system, from Linux's ``/proc``); None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Workers:
    """The worker processes of one :func:`run_on_ranks` call, their store folder and their log."""

    def __init__(self, nproc: int, device: str, verbose: bool, timeout: timedelta):
        self.nproc, self.device, self.verbose, self.timeout = nproc, device, verbose, timeout
        self.workers: list[_Worker] = []
        self.store_dir = Path(tempfile.mkdtemp(prefix="paradiff-store-"))
        log_fd, log_name = tempfile.mkstemp(prefix="paradiff-", suffix=".log")
        os.close(log_fd)
        self.log = Path(log_name)
        self.keep_log = False

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, kind, error, tb) -> None:
        # a second Ctrl-C (or a SIGTERM) during the cleanup waits until it is over
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._clean_up()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _clean_up(self) -> None:
        self.stop()
        for worker in self.workers:
            if not worker.closed:
                os.close(worker.result_fd)
            if not worker.beat_closed:
                os.close(worker.beat_fd)
            if worker.process.stdin is not None:
                with contextlib.suppress(OSError):
                    worker.process.stdin.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)
        if not self.keep_log:
            self.log.unlink(missing_ok=True)

    # --- starting ---------------------------------------------------------------------------------------

    def _environment(self, rank: int, result_fd: int, beat_fd: int) -> dict:
        env = dict(os.environ)
        for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(name, None)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.nproc),
            LOCAL_WORLD_SIZE=str(self.nproc),
            **{RESULT_FD_ENV: str(result_fd), BEAT_FD_ENV: str(beat_fd)},
        )
        ifname = loopback_ifname()
        if ifname is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", ifname)
            env.setdefault("NCCL_SOCKET_IFNAME", ifname)
        # the workers import this very paradiff, whatever their working folder
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if not self.verbose:
            from .quiet import QUIET_ENV

            env.update(QUIET_ENV)
        return env

    def _start(self, payload: bytes, log_file) -> None:
        header = pickle.dumps(
            {
                "sys_path": sys.path,
                "store": str(self.store_dir / "store"),
                "device": self.device,
                "timeout_s": self.timeout.total_seconds(),
                "verbose": self.verbose,
                "log": str(self.log),
                "main": _main_module() if b"__main__" in payload else None,
            }
        )
        for rank in range(self.nproc):
            read_fd, write_fd = os.pipe()
            beat_read, beat_write = os.pipe()
            output = None if self.verbose or rank == 0 else log_file
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE],
                    stdin=subprocess.PIPE,
                    stdout=output,
                    stderr=output,
                    pass_fds=(write_fd, beat_write),
                    env=self._environment(rank, write_fd, beat_write),
                    start_new_session=True,
                )
            except BaseException:
                os.close(read_fd)
                os.close(beat_read)
                raise
            finally:
                os.close(write_fd)
                os.close(beat_write)
            os.set_blocking(read_fd, False)
            os.set_blocking(beat_read, False)
            self.workers.append(_Worker(rank, process, read_fd, bytearray(), beat_read, time.monotonic()))
            try:
                for part in (header, payload):
                    process.stdin.write(struct.pack("<Q", len(part)) + part)
                process.stdin.flush()  # stdin stays open: the worker exits when it closes
            except BrokenPipeError:
                pass  # the worker died at once; the watch loop reports it

    # --- watching ---------------------------------------------------------------------------------------

    def run(self, payload: bytes):
        sys.stdout.flush()
        sys.stderr.flush()
        with open(self.log, "ab") as log_file:
            self._start(payload, log_file)
        first_failure = None
        while True:
            self._poll(timeout_s=0.1)
            failures = self._failures()
            if failures and first_failure is None:
                first_failure = time.monotonic()
            resolved = all(worker.result is not None or self._died(worker) for worker in self.workers)
            if failures and (resolved or time.monotonic() - first_failure > FAILURE_GRACE_S):
                self.stop()  # after reading the failures: the ranks it kills are not failures
                self._raise(failures)
            if not failures and all(worker.result is not None for worker in self.workers):
                break
        self._wait_for_exit()
        return self.workers[0].result[1]

    def _poll(self, timeout_s: float) -> None:
        """Read what the workers sent and their beats (waiting up to ``timeout_s`` for something)."""
        results = {worker.result_fd: worker for worker in self.workers if not worker.closed}
        beats = {worker.beat_fd: worker for worker in self.workers if not worker.beat_closed}
        if not results and not beats:
            time.sleep(timeout_s)
            return
        readable, _, _ = select.select([*results, *beats], [], [], timeout_s)
        for fd in readable:
            if fd in beats:
                self._read_beats(beats[fd])
                continue
            worker = results[fd]
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if chunk:
                worker.received += chunk
                continue
            os.close(fd)
            worker.closed = True
            worker.result = self._decode(worker)

    def _read_beats(self, worker: _Worker) -> None:
        try:
            chunk = os.read(worker.beat_fd, 1 << 12)
        except BlockingIOError:
            return
        if chunk:
            worker.last_beat = time.monotonic()
            return
        os.close(worker.beat_fd)
        worker.beat_closed = True

    def _decode(self, worker: _Worker) -> tuple | None:
        data = bytes(worker.received)
        if len(data) < 8:
            return None
        (size,) = struct.unpack("<Q", data[:8])
        if len(data) < 8 + size:
            return None
        try:
            return pickle.loads(data[8 : 8 + size])
        except Exception as error:  # a result the parent cannot unpickle
            return ("error", f"its result could not be read here: {type(error).__name__}: {error}")

    def _died(self, worker: _Worker) -> bool:
        """True once the worker has exited without a result (what it wrote before exiting read first)."""
        if worker.result is not None or worker.process.poll() is None:
            return False
        while not worker.closed and select.select([worker.result_fd], [], [], 0)[0]:
            chunk = os.read(worker.result_fd, 1 << 20)
            if chunk:
                worker.received += chunk
            else:
                os.close(worker.result_fd)
                worker.closed = True
                worker.result = self._decode(worker)
        return worker.result is None

    def _failures(self) -> list[tuple[str, int, str]]:
        """``(kind, rank, text)`` for every rank that failed so far: kind is paradiff, signal, error, exit or silent."""
        failures = []
        now = time.monotonic()
        for worker in self.workers:
            if worker.result is not None and worker.result[0] != "ok":
                failures.append((worker.result[0], worker.rank, worker.result[1]))
            elif self._died(worker):
                code = worker.process.returncode
                if code < 0:
                    failures.append(("signal", worker.rank, f"was killed by {_signal_name(-code)}"))
                else:
                    failures.append(("exit", worker.rank, f"exited with status {code} without a result"))
            elif worker.result is None and worker.silent_s(now) > SILENT_S:
                silence = f"showed no sign of life for {SILENT_S:g} s (stopped or hung)"
                failures.append(("silent", worker.rank, silence))
        return failures

    def _raise(self, failures: list[tuple[str, int, str]]) -> None:
        """The most telling failure: a ParadiffError, then a rank that died, then an exception.

        A rank that raised waits to be stopped, so its neighbours' collectives do not break before it
        reports; a rank that died breaks them at once, so its death outranks their exceptions.
        """
        order = {"paradiff": 0, "signal": 1, "exit": 1, "silent": 1, "error": 2}
        kind, rank, text = min(failures, key=lambda failure: (order[failure[0]], failure[1]))
        if kind == "paradiff":
            raise ParadiffError(text)
        self.keep_log = True
        pid = self.workers[rank].process.pid
        message = (
            f"rank {rank} (pid {pid}) {text}" if kind in ("signal", "exit", "silent") else f"rank {rank} failed: {text}"
        )
        with open(self.log, "a") as log:
            log.write(f"--- paradiff: {message}; the other ranks were stopped ---\n")
        raise RanksFailed(message, self.log)

    # --- stopping ---------------------------------------------------------------------------------------

    def _wait_for_exit(self) -> None:
        deadline = time.monotonic() + EXIT_GRACE_S
        for worker in self.workers:
            if worker.process.stdin is not None and not worker.process.stdin.closed:
                with contextlib.suppress(OSError):
                    worker.process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):  # stop() kills what is left
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Kill every worker's process group (the worker and what it started) and reap the workers."""
        for worker in self.workers:
            _kill_group(worker.process)
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL does not wait for anything
                worker.process.wait(timeout=10)


def _main_module() -> tuple[str, str] | None:
    """How a worker finds what this process's ``__main__`` defines: ``("module", name)`` after ``python -m``,
    ``("path", file)`` for a script, None otherwise (the way ``multiprocessing``'s spawn does it)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group ``process`` leads (it started a session), or the process alone."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        if process.poll() is None:
            process.kill()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
