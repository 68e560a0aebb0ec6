"""Which ranks are alive, so that a failed transfer names the rank that died or froze, the same on every rank.

A transfer that fails says little: gloo reports "Connection closed by peer [127.0.0.1]:947" or
"Operation timed out!", naming no rank. So every rank of a parallelized pipeline keeps a heartbeat: a
daemon thread adds one to a counter of its own in the rendezvous store (the store every rank already
shares, hosted by torchrun's agent or rank 0) every :data:`BEAT_S` seconds, and the rank writes its host
and process id there once. When a transfer fails, :func:`lost_ranks` reads the peers' counters twice,
:data:`WATCH_S` apart: a rank whose counter did not move is dead or frozen (a stopped process's threads
stop too); one whose counter moved is alive, merely elsewhere in its program. A silent rank on this host
is told dead (its process is gone) from frozen (it is still there) by its process id.

One lost rank makes every other rank's transfers fail in turn, at different times: a neighbour that raised
and exited is silent too by the time a third rank looks. So the first rank to name a lost rank records it
in the store (first writer wins) and every later rank names that one; and a rank that raises a
:class:`~paradiff.errors.PeerFailure` marks itself as having left, so no one blames it.

The thread calls torch's store, which releases the GIL, and costs a store round trip per beat (a file
store, as ``paradiff generate`` uses, grows by about 40 bytes a beat). It is stopped at interpreter exit:
a thread still inside the store's C++ call while the interpreter tears torch down can abort the process
("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

#: Seconds between two beats of one rank.
BEAT_S = 1.0
#: Seconds :func:`lost_ranks` watches the counters for: several beats, so a busy host does not make a
#: live rank look silent.
WATCH_S = 3.0
#: Seconds a read of the store may take before the store itself counts as gone.
STORE_READ_S = 3.0
#: The store key of the first loss a rank recorded (:class:`Loss`, as JSON).
LOST_KEY = "paradiff/lost"


def _key(rank: int) -> str:
    return f"paradiff/heartbeat/{rank}"


def _process_key(rank: int) -> str:
    return f"paradiff/process/{rank}"


def _left_key(rank: int) -> str:
    return f"paradiff/left/{rank}"


class _Heartbeat:
    """One rank's beating thread, bound to the store of the process group it was started for."""

    def __init__(self, store: dist.Store, rank: int):
        self.store, self.rank = store, rank
        store.set(_process_key(rank), f"{socket.gethostname()} {os.getpid()}")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="paradiff-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.store.add(_key(self.rank), 1)
            except Exception:  # the store is gone with its process group: nothing left to report to
                return
            self.stopped.wait(BEAT_S)

    def stop(self) -> None:
        """End the thread, waiting at most one store read for the beat in flight."""
        self.stopped.set()
        self.thread.join(STORE_READ_S)


_current: _Heartbeat | None = None


def start_heartbeat() -> None:
    """Start this rank's heartbeat in the default process group's store (once per process group)."""
    global _current
    store = dist.distributed_c10d._get_default_store()
    if _current is None or _current.store is not store or not _current.thread.is_alive():
        if _current is None:
            atexit.register(_stop_at_exit)
        else:
            _current.stop()
        _current = _Heartbeat(store, dist.get_rank())


def _stop_at_exit() -> None:
    if _current is not None:
        _current.stop()


def _within(read: Callable[[], object], seconds: float):
    """``read()``, or None if it raises or takes longer than ``seconds`` (a store whose host froze)."""
    result: list = []

    def run() -> None:
        try:
            result.append(read())
        except Exception:
            return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


#: How a silent rank is described: its process is gone, it is there but silent, or (another host) unknown.
DEAD, FROZEN, SILENT = "died (its process is gone)", "stopped responding (its process is there, but silent)", ""


@dataclass(frozen=True)
class Loss:
    """The ranks lost first and how (one phrase per rank), as the rank that saw it first (``seen_by``) recorded it;
    no ranks when every peer is alive."""

    ranks: tuple[int, ...] = ()
    how: tuple[str, ...] = ()
    seen_by: int = -1

    def to_json(self) -> str:
        return json.dumps({"ranks": self.ranks, "how": self.how, "seen_by": self.seen_by})

    @classmethod
    def from_json(cls, text: str | bytes) -> Loss:
        data = json.loads(text)
        return cls(tuple(data["ranks"]), tuple(data["how"]), data["seen_by"])


def _process_state(pid: int) -> str:
    """:data:`DEAD` when process ``pid`` has exited (or is a zombie), :data:`FROZEN` while it is still there."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc entry: the process is gone, or this system has no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return DEAD
        except PermissionError:
            pass
        return FROZEN
    return DEAD if state in ("Z", "X") else FROZEN


def _how(store: dist.Store, rank: int) -> str:
    """How silent ``rank`` is gone, from its process when it runs on this host; else :data:`SILENT` (unknown)."""
    if not store.check([_process_key(rank)]):
        return SILENT
    host, pid = store.get(_process_key(rank)).decode().rsplit(" ", 1)
    return _process_state(int(pid)) if host == socket.gethostname() else SILENT


def _arrival_key(count: int, rank: int) -> str:
    return f"paradiff/arrived/{count}/{rank}"


def arrive(timeout_s: float) -> list[int]:
    """Say this rank has arrived (its n-th arrival) and wait up to ``timeout_s`` for every rank's n-th; the ranks
    that have not arrived by then (none: every rank is here)."""
    store, me = _current.store, _current.rank
    count = store.add(f"paradiff/arrivals/{me}", 1)
    keys = [_arrival_key(count, rank) for rank in range(dist.get_world_size())]
    store.set(keys[me], "1")
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # DistStoreError or RuntimeError("Wait timeout"), by torch release
        return [rank for rank, key in enumerate(keys) if not store.check([key])]
    return []


def whereabouts(ranks: list[int]) -> dict[int, str]:
    """What each of the global ``ranks`` is doing, by its heartbeat over :data:`WATCH_S` seconds: ``alive`` (beating),
    ``unseen`` (it never started one), or how a silent one is gone (:data:`DEAD`, :data:`FROZEN`, :data:`SILENT`)."""
    store = _current.store
    started = [rank for rank in ranks if store.check([_key(rank)])]
    before = [store.add(_key(rank), 0) for rank in started]
    time.sleep(WATCH_S if started else 0)
    after = [store.add(_key(rank), 0) for rank in started]
    found = {rank: "unseen" for rank in ranks}
    for rank, first, last in zip(started, before, after, strict=True):
        found[rank] = "alive" if first != last else _how(store, rank)
    return found


def _recorded(store: dist.Store) -> Loss | None:
    return Loss.from_json(store.get(LOST_KEY)) if store.check([LOST_KEY]) else None


def lost_ranks(ranks: list[int]) -> Loss | None:
    """The first loss among the world's ranks, as recorded by whichever rank saw it first; else of the global
    ``ranks``, those that showed no sign of life for :data:`WATCH_S` seconds and have not left after a failure
    of their own (recorded here for every other rank). An empty :class:`Loss` when they are all alive; None if
    no heartbeat runs here or the store does not answer (then its host, torchrun's agent or rank 0, is gone)."""
    if _current is None or not ranks:
        return None
    store, me = _current.store, _current.rank
    recorded = _within(lambda: [_recorded(store)], STORE_READ_S)
    if recorded is None or recorded[0] is not None:
        return None if recorded is None else recorded[0]

    def read() -> list[int]:
        return [store.add(_key(rank), 0) for rank in ranks]

    before = _within(read, STORE_READ_S)
    time.sleep(WATCH_S)
    after = _within(read, STORE_READ_S)
    if before is None or after is None:
        return None

    def decide() -> Loss:
        silent = [rank for rank, first, last in zip(ranks, before, after, strict=True) if first == last]
        silent = [rank for rank in silent if not store.check([_left_key(rank)])]
        if not silent:
            return _recorded(store) or Loss()
        found = Loss(tuple(silent), tuple(_how(store, rank) for rank in silent), me)
        return Loss.from_json(store.compare_set(LOST_KEY, "", found.to_json()))

    return _within(decide, STORE_READ_S)


def mark_left() -> None:
    """Record that this rank is leaving after a failure it reports itself, so that no other rank blames it."""
    if _current is not None:
        _within(lambda: _current.store.set(_left_key(_current.rank), "1"), STORE_READ_S)
