"""The front's way to the ranks: start them, hand them batches, hear back, and restart them when one is lost.

:class:`LaunchedRanks` runs the ranks as worker processes of paradiff's launcher (:func:`paradiff.launch.run_on_ranks`),
rank 0 connected to the front through a Unix socket in a private folder. The launcher watches every worker (an
exit, a signal, five silent seconds), stops them all at the first failure and says which rank it was; the
front stays up, answers the batch in flight 503, and starts a new group, which loads the model again (also when
a rank is lost while loading; a refusal every rank raises, a model that cannot load, fails the server at once).
After ``--max-restarts`` restarts in a row without a request served between them, it gives up: the server fails.

:class:`LocalRanks` is rank 0 of a ``torchrun`` job: the ranks' loop runs in a thread of the front's own process.
A lost rank fails the server (its process exits 1); restarting the job is torchrun's (``--max-restarts``).

Both report to the scheduler with :meth:`~.scheduler.Scheduler.event`: ``ready``, ``done``, ``lost``, ``failed``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import ParadiffError
from .link import Closed, SocketLink, queue_pair
from .ranks import run_ranks, serve_on_rank
from .settings import ServeSettings

#: Seconds the front waits for the ranks to stop after it asked them to.
STOP_S = 60.0


def say(text: str) -> None:
    print(f"paradiff serve: {' '.join(text.split())}", file=sys.stderr, flush=True)


def _pump(link, scheduler, ready: threading.Event) -> None:
    """Pass rank 0's messages to the scheduler until the link closes."""
    while True:
        try:
            message = link.receive()
        except Closed:
            return
        if message[0] == "ready":
            ready.set()
            card = message[1]
            print(f"paradiff serve: ready ({card.model}, {card.pipeline}, on {card.nproc} ranks)", flush=True)
            scheduler.event("ready", card)
        elif message[0] == "done":
            scheduler.event("done", message[1], message[2])


class LaunchedRanks:
    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.folder = Path(tempfile.mkdtemp(prefix="paradiff-serve-"))
        self.address = str(self.folder / "front.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(1)
        self.listener.settimeout(0.2)
        self.link: SocketLink | None = None
        self.stopping = threading.Event()
        self.restarts_in_a_row = 0
        self.thread: threading.Thread | None = None

    def start(self, scheduler) -> None:
        self.thread = threading.Thread(target=self._supervise, args=(scheduler,), name="paradiff-ranks", daemon=True)
        self.thread.start()

    def send(self, batch, asked: bool) -> None:
        """Hand ``batch`` to rank 0; if the group has just gone, its ``lost`` event answers the batch."""
        link = self.link
        if link is not None:
            with contextlib.suppress(Closed):
                link.send(("batch", batch, asked))

    def served(self) -> None:
        """A request was drawn: the restarts before it no longer count as in a row."""
        self.restarts_in_a_row = 0

    def stop(self) -> None:
        """Ask the ranks to stop (after the scheduler drained), wait for them, and clean up."""
        self.stopping.set()
        self._ask_to_stop()
        if self.thread is not None:
            self.thread.join(STOP_S)
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _ask_to_stop(self) -> None:
        link = self.link
        if link is not None:
            with contextlib.suppress(Closed):
                link.send(("stop",))

    def _supervise(self, scheduler) -> None:
        while True:
            ready = threading.Event()
            error, refused = self._run_group(scheduler, ready)
            if self.stopping.is_set():
                return
            if refused:  # the model or the settings cannot run: starting again would not help
                scheduler.event("refused", error)
                return
            if error is None:
                error = "the ranks stopped on their own"
            if not ready.is_set():
                error = f"the ranks failed while loading: {error}"
            self.restarts_in_a_row += 1
            limit = self.settings.max_restarts
            if self.restarts_in_a_row > limit:
                scheduler.event("failed", f"{error}; gave up after {limit} restarts in a row (--max-restarts)")
                return
            say(f"{error}; restarting the ranks ({self.restarts_in_a_row} of at most {limit} in a row)")
            scheduler.event("lost", error)

    def _run_group(self, scheduler, ready: threading.Event) -> tuple[str | None, bool]:
        """Run one group of ranks until it ends; what ended it (None: asked to stop), and whether it was a refusal
        every rank raised (a :class:`~paradiff.errors.ParadiffError`: bad settings or a model that cannot load)."""
        from ..launch import run_on_ranks

        failure: list[tuple[str, bool]] = []

        def run() -> None:
            settings = self.settings
            try:
                run_on_ranks(
                    serve_on_rank,
                    settings.nproc,
                    settings,
                    self.address,
                    device=settings.device,
                    verbose=settings.verbose,
                    spawn_always=True,
                )
            except BaseException as error:
                log = getattr(error, "log", None)
                failure.append((f"{error} (details in {log})" if log else str(error), isinstance(error, ParadiffError)))

        runner = threading.Thread(target=run, name="paradiff-launcher", daemon=True)
        runner.start()
        link = self._accept(runner)
        if link is not None:
            self.link = link
            if self.stopping.is_set():
                self._ask_to_stop()
            _pump(link, scheduler, ready)
            self.link = None
            link.close()
        runner.join()
        return failure[0] if failure else (None, False)

    def _accept(self, runner: threading.Thread) -> SocketLink | None:
        """Rank 0's connection, or None if the ranks ended before it connected."""
        while runner.is_alive():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(None)
            return SocketLink(connection)
        return None


class LocalRanks:
    """Rank 0 of a torchrun job: the ranks' loop in a thread of this process, linked by a pair of queues."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.front, self.ranks = queue_pair()
        self.thread: threading.Thread | None = None

    def start(self, scheduler) -> None:
        def run() -> None:
            try:
                run_ranks(self.settings, self.ranks)
            except ParadiffError as error:  # a refusal escapes the ranks' loop only before it loads
                scheduler.event("refused", str(error))
            except BaseException as error:
                scheduler.event("failed", f"{type(error).__name__}: {error}")
            finally:
                self.ranks.close()

        self.thread = threading.Thread(target=run, name="paradiff-ranks", daemon=True)
        self.thread.start()
        threading.Thread(
            target=_pump, args=(self.front, scheduler, threading.Event()), name="paradiff-link", daemon=True
        ).start()

    def send(self, batch, asked: bool) -> None:
        self.front.send(("batch", batch, asked))

    def served(self) -> None:
        pass

    def stop(self) -> None:
        self.front.send(("stop",))
        if self.thread is not None:
            self.thread.join(STOP_S)
