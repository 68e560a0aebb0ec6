"""The front's queue: every accepted request waits here, goes to the ranks in turn, and gets exactly one reply.

One batch is with the ranks at a time (they run one call at a time). The queue is bounded: a request that
finds it full is answered 429 with a ``Retry-After`` estimate. Each request has a deadline
(``--request-timeout``): one still queued at it is answered 504 and never runs; one the ranks are drawing
is answered 504 at it, and what they draw is dropped. A client that disconnects while its request waits is
dropped before it starts. With ``--max-batch`` above 1, queued requests of the head's shape are drawn in the
same call.

The ranks' events (:mod:`.group`) arrive from other threads and are handled on the event loop: ``ready``
(with the model's card), ``done`` (a batch's outcome), ``lost`` (a rank died: the batch in flight is answered
503 naming it, health turns ``restarting`` while the ranks restart, the queue waits) and ``failed`` (no more
restarts: everything waiting is answered 503 and the server stops).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .card import ModelCard
from .errors import ApiError
from .jobs import Batch, Drawn, Refused, Request
from .metrics import Metrics
from .settings import ServeSettings

#: Seconds between two checks that a waiting client is still connected.
DISCONNECT_POLL_S = 0.25
#: Finished video jobs kept for ``GET /v1/videos/{id}`` (the oldest are forgotten first).
VIDEOS_KEPT = 64
#: Seconds a client is asked to wait (``Retry-After``) while the ranks load or restart.
RETRY_LOADING_S = 5


@dataclass(eq=False)
class Pending:
    """An accepted request on its way: queued, then in progress, then done (answered once)."""

    request: Request
    asked: bool
    arrived: float
    deadline: float
    future: asyncio.Future
    created_at: int = field(default_factory=lambda: int(time.time()))
    state: str = "queued"
    #: The client went away before the request started: it is dropped.
    gone: bool = False
    completed_at: int | None = None


def outcome_of(status: int) -> str:
    """The metrics' outcome of an error reply."""
    if status == 429:
        return "rejected"
    if status == 504:
        return "timeout"
    return "invalid" if status < 500 else "failed"


class Scheduler:
    def __init__(self, settings: ServeSettings, metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.health = "loading"
        self.card: ModelCard | None = None
        self.last_error: str | None = None
        self.queue: deque[Pending] = deque()
        self.running: list[Pending] = []
        self.videos: OrderedDict[str, Pending] = OrderedDict()
        self.draining = False
        self.failed = False
        self.refused = False
        #: Mean seconds of a call, for ``Retry-After`` (None until one has run).
        self.call_s: float | None = None
        self.ranks = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_server: Callable[[], None] = lambda: None

    def attach(self, ranks, loop: asyncio.AbstractEventLoop, stop_server: Callable[[], None]) -> None:
        """Bind to the ranks (:mod:`.group`) and the event loop; ``stop_server`` ends the server after a failure."""
        self.ranks, self.loop, self.stop_server = ranks, loop, stop_server

    # --- events from the ranks (any thread) ----------------------------------------------------------------

    def event(self, name: str, *args) -> None:
        """Handle the ranks' event ``name`` (``ready``, ``done``, ``lost``, ``refused``, ``failed``) on the loop."""
        self.loop.call_soon_threadsafe(getattr(self, f"_{name}"), *args)

    def _ready(self, card: ModelCard) -> None:
        self.card, self.health = card, "ready"
        self._dispatch()

    def _done(self, ids: tuple[str, ...], outcome) -> None:
        batch, self.running = self.running, []
        if tuple(pending.request.id for pending in batch) != tuple(ids):
            batch = [pending for pending in batch if pending.request.id in ids]
        if isinstance(outcome, Refused):
            for pending in batch:
                self._answer(pending, ApiError(outcome.status, outcome.message))
        else:
            for pending, drawn in zip(batch, outcome, strict=True):
                self._answer(pending, drawn)
            if outcome:
                seconds = outcome[0].seconds - outcome[0].planning_s
                self.metrics.step.observe(seconds / batch[0].request.steps)
                self.call_s = seconds if self.call_s is None else 0.8 * self.call_s + 0.2 * seconds
            self.ranks.served()
        self._dispatch()

    def _lost(self, message: str) -> None:
        self.health, self.last_error = "restarting", message
        self.metrics.restarts += 1
        batch, self.running = self.running, []
        for pending in batch:
            self._answer(
                pending,
                ApiError(
                    503,
                    f"the ranks lost a rank while drawing this request: {message}; the server is restarting its "
                    "ranks, ask again",
                    headers={"Retry-After": str(RETRY_LOADING_S)},
                ),
            )

    def _refused(self, reason: str) -> None:
        """The ranks refused the settings or the model before loading: the server fails as bad input does."""
        self.refused = True
        self._failed(f"the ranks could not start: {reason}")

    def _failed(self, message: str) -> None:
        self.health, self.last_error, self.failed = "failed", message, True
        batch, self.running = self.running, []
        for pending in [*batch, *self.queue]:
            self._answer(pending, ApiError(503, f"the server has stopped serving: {message}"))
        self.queue.clear()
        self.stop_server()

    # --- requests -------------------------------------------------------------------------------------------

    def model_card(self) -> ModelCard:
        """The card, or a 503 while the ranks first load, after a failure, or while shutting down."""
        if self.failed:
            raise ApiError(503, f"the server has stopped serving: {self.last_error}")
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if self.card is None:
            raise ApiError(
                503, "the model is still loading; ask again shortly", headers={"Retry-After": str(RETRY_LOADING_S)}
            )
        return self.card

    def accept(self, request: Request, asked: bool) -> Pending:
        """Queue ``request``, or answer 429 when the queue is full."""
        if len(self.queue) >= self.settings.max_queue:
            raise ApiError(
                429,
                f"the queue is full ({self.settings.max_queue} requests wait); ask again later",
                headers={"Retry-After": str(self._retry_after())},
            )
        now = time.monotonic()
        pending = Pending(request, asked, now, now + self.settings.request_timeout_s, self.loop.create_future())
        self.queue.append(pending)
        if request.kind == "video":
            self._keep_video(pending)
        self._dispatch()
        return pending

    def _retry_after(self) -> int:
        waiting = len(self.queue) + len(self.running)
        per_call = self.call_s if self.call_s is not None else RETRY_LOADING_S
        return max(1, math.ceil(waiting * per_call))

    async def reply(self, pending: Pending, disconnected: Callable[[], Awaitable[bool]] | None = None) -> Drawn | None:
        """What ``pending`` gets (an :class:`ApiError` is raised); None when its client left before it started.

        Enforces the deadline and, with ``disconnected``, drops the request if its client goes while it waits.
        """
        while not pending.future.done():
            remaining = pending.deadline - time.monotonic()
            if remaining <= 0:
                self._expire(pending)
                break
            step = min(remaining, DISCONNECT_POLL_S) if disconnected is not None else remaining
            await asyncio.wait({pending.future}, timeout=step)
            if not pending.future.done() and pending.state == "queued" and disconnected and await disconnected():
                self._drop(pending)
                return None
        return pending.future.result()

    def _expire(self, pending: Pending) -> None:
        waited = self.settings.request_timeout_s
        if pending.state == "queued":
            if pending in self.queue:
                self.queue.remove(pending)
            message = f"the request waited {waited:g} s in the queue without starting (--request-timeout)"
        else:
            message = f"the request was still being drawn after {waited:g} s (--request-timeout); its result is dropped"
        self._answer(pending, ApiError(504, message))

    def _drop(self, pending: Pending) -> None:
        if pending in self.queue:
            self.queue.remove(pending)
        pending.state = "done"
        pending.future.cancel()
        self.metrics.answered("cancelled")

    def _answer(self, pending: Pending, outcome) -> None:
        """Settle ``pending`` once: a :class:`Drawn` or an :class:`ApiError`; later outcomes are ignored."""
        if pending.state == "done":
            return
        pending.state, pending.completed_at = "done", int(time.time())
        if isinstance(outcome, ApiError):
            pending.future.set_exception(outcome)
            self.metrics.answered(outcome_of(outcome.status))
        else:
            pending.future.set_result(outcome)
            self.metrics.answered("ok", time.monotonic() - pending.arrived)

    # --- handing batches to the ranks -----------------------------------------------------------------------

    def _startable(self, pending: Pending) -> bool:
        """Whether a queued request may still start: its client is there and its deadline has not passed."""
        if pending.gone or pending.state != "queued":
            return False
        if time.monotonic() >= pending.deadline:
            self._expire(pending)
            return False
        return True

    def _dispatch(self) -> None:
        if self.running or self.health != "ready":
            return
        while self.queue:
            head = self.queue.popleft()
            if self._startable(head):
                break
        else:
            return
        batch = [head, *self._same_shape(head)]
        for pending in batch:
            pending.state = "in_progress"
        self.running = batch
        self.ranks.send(Batch(tuple(pending.request for pending in batch)), head.asked)

    def _same_shape(self, head: Pending) -> list[Pending]:
        """Queued requests drawn in the head's call (batching): same shape and setting, up to ``--max-batch``."""
        if self.settings.max_batch <= 1 or not self.card.batchable:
            return []
        key, found = head.request.batch_key(), []
        for pending in list(self.queue):
            if len(found) + 1 >= self.settings.max_batch:
                break
            if pending.request.batch_key() == key and pending.asked == head.asked and self._startable(pending):
                self.queue.remove(pending)
                found.append(pending)
        return found

    def _keep_video(self, pending: Pending) -> None:
        self.videos[pending.request.id] = pending
        finished = [key for key, job in self.videos.items() if job.state == "done"]
        for key in finished[: max(0, len(self.videos) - VIDEOS_KEPT)]:
            del self.videos[key]

    async def drain(self) -> None:
        """Stop taking requests and wait until every accepted one has its reply."""
        self.draining = True
        while (self.queue or self.running) and not self.failed:
            await asyncio.sleep(0.05)
