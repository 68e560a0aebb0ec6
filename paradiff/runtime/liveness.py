"""Which ranks are alive, so that a failed transfer can name the rank that died or froze.

A transfer that fails says little: gloo reports "Connection closed by peer [127.0.0.1]:947" or
"Operation timed out!", naming no rank. So every rank of a parallelized pipeline keeps a heartbeat: a
daemon thread adds one to a counter of its own in the rendezvous store (the store every rank already
shares, hosted by torchrun's agent or rank 0) every :data:`BEAT_S` seconds. When a transfer fails,
:func:`silent_ranks` reads the peers' counters twice, :data:`WATCH_S` apart: a rank whose counter did
not move is dead or frozen (a stopped process's threads stop too); one whose counter moved is alive,
merely elsewhere in its program. The thread calls torch's store, which releases the GIL, and costs a
store round trip per beat (a file store, as ``paradiff generate`` uses, grows by about 40 bytes a beat).
It is stopped at interpreter exit: a thread still inside the store's C++ call while the interpreter tears
torch down can abort the process ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

#: Seconds between two beats of one rank.
BEAT_S = 1.0
#: Seconds :func:`silent_ranks` watches the counters for: several beats, so a busy host does not make a live
#: rank look silent.
WATCH_S = 3.0
#: Seconds a read of the store may take before the store itself counts as gone.
STORE_READ_S = 3.0


def _key(rank: int) -> str:
    return f"paradiff/heartbeat/{rank}"


class _Heartbeat:
    """One rank's beating thread, bound to the store of the process group it was started for."""

    def __init__(self, store: dist.Store, rank: int):
        self.store, self.rank = store, rank
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


def _within(read: Callable[[], list[int]], seconds: float) -> list[int] | None:
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


def silent_ranks(ranks: list[int]) -> list[int] | None:
    """Of the global ``ranks``, those that showed no sign of life for :data:`WATCH_S` seconds; None if no
    heartbeat runs here or the store does not answer (then its host, torchrun's agent or rank 0, is gone)."""
    if _current is None or not ranks:
        return None
    store = _current.store

    def read() -> list[int]:
        return [store.add(_key(rank), 0) for rank in ranks]

    before = _within(read, STORE_READ_S)
    time.sleep(WATCH_S)
    after = _within(read, STORE_READ_S)
    if before is None or after is None:
        return None
    return [rank for rank, first, last in zip(ranks, before, after, strict=True) if first == last]
