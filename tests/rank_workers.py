"""A reusable pool of worker processes joined in one gloo process group on loopback (tests and benchmarks only).

Spawning a process and importing torch costs seconds, so tests share one :class:`RankPool`
and run many small multi-rank cases on it::

    def _my_case(n):                      # module level, so the workers can import it
        import torch.distributed as dist
        return dist.get_rank() * n

    with RankPool(2) as pool:
        assert pool.run(_my_case, 10) == [0, 10]

Rules for tasks
---------------
* ``fn`` is pickled by reference: it must be a module-level function (or a picklable callable such
  as ``functools.partial`` of one) whose module the workers can import. Workers are started with the
  ``spawn`` method, which copies the parent's ``sys.path``; with pytest's default ``prepend`` import
  mode the ``tests/`` directory is on that path, so functions defined in a test module
  (``test_foo.py`` imported as ``test_foo``) import fine in workers. As a fallback (e.g. pytest's
  ``importlib`` mode, or a module loaded from a file path) :meth:`RankPool.run` sends the file of
  ``fn``'s module along, and a worker that cannot import the module by name loads it from that file
  under the same name. Lambdas and nested functions are rejected with ``TypeError``.
* ``args``/``kwargs`` and the return value are pickled (plain :mod:`pickle`, no shared memory).
  Keep results small: python numbers, strings, numpy arrays or small CPU tensors. Return
  ``tensor.tolist()`` or ``tensor.numpy()`` rather than large tensors.
* ``timeout_s`` is a keyword of :meth:`RankPool.run` itself and cannot be passed through to ``fn``.
* Workers are long-lived: module globals set by one task are seen by later tasks on the same pool
  (useful for caching a model, surprising otherwise). Workers are daemonic, so tasks cannot start
  child processes with :mod:`multiprocessing`.

Processes
---------
* Each worker runs this file as a script (``runpy.run_path``, module name
  ``__paradiff_rank_worker__``), so starting a worker imports torch but not the ``paradiff``
  package; a task pays for ``import paradiff`` (which imports diffusers) only if its module
  needs it. A pool made with ``preload`` forks its workers from a server that imported those
  modules once instead (the shared pools in conftest.py), so neither a start nor a restart pays.
* ``spawn`` (the default) re-imports the parent's ``__main__`` module in every worker (pytest's entry point is
  harmless). A script that creates a pool needs an ``if __name__ == "__main__":`` guard, and
  heavy imports at its top level are paid again by every worker.
* Each worker is connected to the parent by its own pipe; workers exit on their own when the
  parent goes away. Workers inherit the parent's stdout/stderr (under pytest their prints land in
  the captured output).
* A pool is not thread-safe: call ``run`` from one thread at a time.

Failures
--------
If a task raises on any rank, :meth:`RankPool.run` raises :class:`RankFailure` with every failing
rank's traceback. A worker process that dies is reported the same way (with its exit code) as soon
as it is noticed. If not every rank answers within the timeout, :class:`RankTimeout` (a
:class:`TimeoutError`) is raised. After any failure the other ranks may be stuck in a collective, so
the workers are terminated and the next :meth:`RankPool.run` transparently starts a fresh group.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import runpy
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankFailure", "RankPool", "RankTimeout", "find_free_port"]

_READY_ID = 0  # task id of the "process group is up" message every worker sends once
# Workers run this file as a script under this name (see RankPool._start), so that starting a
# worker imports torch but not the paradiff package.
_WORKER_RUN_NAME = "__paradiff_rank_worker__"
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


class RankFailure(RuntimeError):
    """One or more ranks raised (or their worker process died) while running a task.

    ``failures`` maps rank -> traceback text (or a description of the process death);
    ``pending`` lists ranks that had not answered when the pool gave up on them.
    """

    def __init__(self, what: str, failures: dict[int, str], pending: list[int] | None = None):
        self.failures = dict(sorted(failures.items()))
        self.pending = sorted(pending or [])
        lines = [f"{what}: rank(s) {list(self.failures)} failed"]
        if self.pending:
            lines[0] += f"; rank(s) {self.pending} had not answered (probably waiting in a collective)"
        for rank, text in self.failures.items():
            lines.append(f"----- rank {rank} -----")
            lines.append(text.rstrip())
        super().__init__("\n".join(lines))


class RankTimeout(TimeoutError):
    """Not every rank answered within the timeout. ``pending`` lists the ranks that did not."""

    def __init__(self, message: str, pending: list[int]):
        self.pending = sorted(pending)
        super().__init__(message)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still grab it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((name for name in names if name.startswith("lo")), None)


def _module_hints(fn: Any) -> list[tuple[str, str]]:
    """(module name, file) pairs a worker may need to load by path to unpickle ``fn``."""
    hints = []
    seen = set()
    obj = fn
    # unwrap functools.partial chains so their underlying function's module is hinted too
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        name = getattr(obj, "__module__", None)
        module = sys.modules.get(name) if isinstance(name, str) else None
        path = getattr(module, "__file__", None)
        if name and name != "__main__" and path and (name, path) not in hints:
            hints.append((name, path))
        obj = getattr(obj, "func", None)
    return hints


def _check_task_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"RankPool.run needs a callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"RankPool.run cannot send {qualname!r} to worker processes: task functions must be "
            "defined at module level in an importable module (not lambdas or nested functions)"
        )


def _ensure_importable(name: str, path: str) -> None:
    """Make module ``name`` importable in this worker, loading it from ``path`` if needed."""
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import task module {name!r} by name or from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    timeout_s: float,
    extra_env: dict[str, str],
    conn: Any,
) -> None:
    """Entry point of one worker process (spawned): join the gloo group, then serve tasks.

    ``conn`` is this worker's end of a duplex pipe to the parent. Every message is a pickled
    tuple sent with ``send_bytes``: parent -> worker ``(task_id, hints, payload)`` or ``None`` to
    stop; worker -> parent ``(task_id, "ok", pickled_result)`` or ``(task_id, "error", text)``.
    """
    # Ctrl-C goes to the whole process group; the parent owns shutdown, so workers ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
        }
    )
    ifname = _loopback_ifname()
    if ifname is not None:
        # gloo otherwise picks the interface that the hostname resolves to, which in some
        # containers is not reachable; every rank lives on this machine.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    os.environ.update(extra_env)

    def reply(task_id: int, status: str, data: Any) -> None:
        conn.send_bytes(pickle.dumps((task_id, status, data), protocol=_PICKLE_PROTOCOL))

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # fails if torch already ran parallel work
            torch.set_num_interop_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except BaseException:
        with contextlib.suppress(OSError):
            reply(_READY_ID, "error", traceback.format_exc())
        sys.exit(1)
    reply(_READY_ID, "ok", None)

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(2)  # the parent is gone: nobody will stop us or read results
        task = pickle.loads(message)
        if task is None:
            break
        task_id, hints, payload = task
        try:
            for name, path in hints:
                _ensure_importable(name, path)
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            answer = ("ok", pickle.dumps(result, protocol=_PICKLE_PROTOCOL))
        except BaseException:  # report everything, including SystemExit from the task
            answer = ("error", traceback.format_exc())
        try:
            reply(task_id, *answer)
        except (EOFError, OSError):
            os._exit(2)

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    conn.close()
    # Skip the interpreter's teardown: with diffusers and transformers imported it takes a second or two of CPU
    # per worker, which every pool's close would wait for, and there is nothing left to clean up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """``world_size`` spawned worker processes in one gloo process group on 127.0.0.1.

    ``run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank and returns the
    results ordered by rank. See the module docstring for the rules tasks must follow.

    ``timeout_s`` is the default per-``run`` timeout, the start-up timeout and the gloo
    collective timeout. ``threads_per_rank`` is passed to ``torch.set_num_threads`` in each
    worker. ``env`` adds/overrides environment variables in the workers. ``failure_grace_s`` is
    how long ``run`` keeps collecting other ranks' answers after the first failure arrives.
    ``preload`` names modules the workers' tasks import: the workers are then forked from
    ``multiprocessing``'s fork server, which imports them once (diffusers with peft and torchao
    installed costs seconds of CPU in every process that imports it), instead of spawned fresh.
    A forked worker starts with the fork server's environment and memory, so benchmarks that
    measure a worker's memory keep the default.
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 120.0,
        threads_per_rank: int = 1,
        *,
        env: dict[str, str] | None = None,
        failure_grace_s: float = 1.0,
        stop_timeout_s: float = 5.0,
        preload: tuple[str, ...] = (),
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
        self.world_size = int(world_size)
        self.timeout_s = float(timeout_s)
        self.threads_per_rank = int(threads_per_rank)
        self.env = dict(env or {})
        self.failure_grace_s = float(failure_grace_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.starts = 0  # how many times a group of workers was started (1 + restarts)
        self._ctx = multiprocessing.get_context("forkserver" if preload else "spawn")
        self._preload = list(preload)
        self._task_ids = itertools.count(_READY_ID + 1)
        self._procs: list[Any] | None = None
        self._conns: list[Any] = []
        self._closed = False
        self._start()

    # ------------------------------------------------------------------ public API

    @property
    def is_running(self) -> bool:
        """Whether a group of workers is currently up (False after a failure until the next run)."""
        return self._procs is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, by rank (empty when none are running)."""
        return [p.pid for p in self._procs] if self._procs is not None else []

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return ``[result_rank0, result_rank1, ...]``.

        Raises :class:`RankFailure` if any rank raised or its process died, :class:`RankTimeout`
        (a ``TimeoutError``) if not all ranks answered within ``timeout_s`` (default: the pool's).
        After either, the workers are terminated and the next call starts fresh ones.
        Raises ``RuntimeError`` after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("RankPool is closed; create a new RankPool")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        _check_task_callable(fn)
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=_PICKLE_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"RankPool.run could not pickle the task {getattr(fn, '__qualname__', fn)!r} or its "
                f"arguments: {exc}. Task functions must be module-level functions in an importable "
                "module and arguments must be picklable."
            ) from exc
        hints = _module_hints(fn)
        if self._procs is None:
            self._start()
        task_id = next(self._task_ids)
        what = f"running {getattr(fn, '__qualname__', repr(fn))}"
        try:
            message = pickle.dumps((task_id, hints, payload), protocol=_PICKLE_PROTOCOL)
            for conn in self._conns:
                # a dead worker shows up as a failure in _collect, with its exit code
                with contextlib.suppress(OSError):
                    conn.send_bytes(message)
            replies = self._collect(task_id, timeout, what)
        except BaseException:
            self._teardown(graceful=False)
            raise
        results = []
        for rank in range(self.world_size):
            try:
                results.append(pickle.loads(replies[rank]))
            except Exception:
                self._teardown(graceful=False)
                raise RankFailure(
                    f"{what}: could not unpickle result in parent", {rank: traceback.format_exc()}
                ) from None
        return results

    def close(self) -> None:
        """Stop the workers (they destroy their process group), terminating any that hang."""
        if self._closed:
            return
        self._closed = True
        self._teardown(graceful=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.is_running else "stopped")
        return f"RankPool(world_size={self.world_size}, {state}, starts={self.starts})"

    # ------------------------------------------------------------------ internals

    def _start(self, attempts: int = 2) -> None:
        if self._preload:  # takes effect when the fork server starts (the first start, or after it was stopped)
            self._ctx.set_forkserver_preload(self._preload)
        for attempt in range(attempts):
            port = find_free_port()
            self._procs, self._conns = [], []
            for rank in range(self.world_size):
                parent_end, child_end = self._ctx.Pipe(duplex=True)
                worker_kwargs = {
                    "rank": rank,
                    "world_size": self.world_size,
                    "port": port,
                    "threads": self.threads_per_rank,
                    "timeout_s": self.timeout_s,
                    "extra_env": self.env,
                    "conn": child_end,
                }
                proc = self._ctx.Process(
                    target=runpy.run_path,
                    args=(os.path.abspath(__file__),),
                    kwargs={
                        "init_globals": {"_WORKER_KWARGS": worker_kwargs},
                        "run_name": _WORKER_RUN_NAME,
                    },
                    name=f"paradiff-rank{rank}",
                    daemon=True,
                )
                proc.start()
                # only the child may hold its end, so that either side sees EOF when the other dies
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            self.starts += 1
            try:
                self._collect(_READY_ID, self.timeout_s, f"starting {self.world_size} gloo ranks")
                return
            except RankFailure as exc:
                self._teardown(graceful=False)
                # retry only if another process took the port between find_free_port and rank 0's
                # store binding it; other start-up errors would just fail again
                text = "\n".join(exc.failures.values()).lower()
                port_taken = "eaddrinuse" in text or "address already in use" in text
                if not port_taken or attempt + 1 == attempts:
                    raise
            except BaseException:
                self._teardown(graceful=False)
                raise

    def _collect(self, task_id: int, timeout_s: float, what: str) -> dict[int, Any]:
        """Wait for every rank's answer to ``task_id``; return rank -> payload of "ok" answers."""
        procs, conns = self._procs, self._conns
        assert procs is not None
        deadline = time.monotonic() + timeout_s
        grace_deadline: float | None = None
        ok: dict[int, Any] = {}
        failures: dict[int, str] = {}

        def pending() -> list[int]:
            return [r for r in range(self.world_size) if r not in ok and r not in failures]

        def died(rank: int) -> str:
            proc = procs[rank]
            proc.join(1.0)  # the pipe may close a moment before the exit code is known
            return f"worker process (pid {proc.pid}) died with exit code {proc.exitcode} while {what}"

        while pending():
            now = time.monotonic()
            if grace_deadline is not None and now >= grace_deadline:
                break
            if now >= deadline:
                if failures:
                    break
                raise RankTimeout(
                    f"{what}: rank(s) {pending()} did not answer within {timeout_s:g} s "
                    f"(rank(s) {sorted(ok)} did); the pool's workers will be restarted",
                    pending(),
                )
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            waiting = {}
            for rank in pending():
                waiting[conns[rank]] = rank
                waiting[procs[rank].sentinel] = rank
            ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, limit - now))
            for rank in sorted({waiting[obj] for obj in ready}):
                conn = conns[rank]
                if not conn.poll():  # only the sentinel fired: the process ended without answering
                    failures[rank] = died(rank)
                    continue
                try:
                    tid, status, data = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    failures[rank] = died(rank)
                    continue
                if tid != task_id:
                    continue  # stale answer to an earlier task; cannot normally happen
                if status == "ok":
                    ok[rank] = data
                else:
                    failures[rank] = data
            if failures and grace_deadline is None:
                grace_deadline = time.monotonic() + self.failure_grace_s
        if failures:
            raise RankFailure(what, failures, pending())
        return ok

    def _teardown(self, graceful: bool) -> None:
        procs, self._procs = self._procs, None
        conns, self._conns = self._conns, []
        if procs is None:
            return
        if graceful:
            stop = pickle.dumps(None, protocol=_PICKLE_PROTOCOL)
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(stop)
            deadline = time.monotonic() + self.stop_timeout_s
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in conns:
            conn.close()
        for proc in procs:
            with contextlib.suppress(ValueError):
                proc.close()


if __name__ == _WORKER_RUN_NAME:  # a worker process started by RankPool._start
    _worker_main(**globals()["_WORKER_KWARGS"])
