"""The server's queue on its own (no ranks, no HTTP): one reply per accepted request, deadlines, a full queue,
a client that leaves, batching of one shape, a lost rank and a failed group."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from paradiff.serve.card import ModelCard
from paradiff.serve.errors import ApiError
from paradiff.serve.jobs import Drawn, Request
from paradiff.serve.scheduler import Scheduler
from paradiff.serve.settings import ServeSettings

CARD = ModelCard(model="m", pipeline="Pipe", video=False, nproc=2, default_size=(64, 64), pixels=8)
BASE = Request("", "image", "a circle", None, 1, 64, 64, 2, 2.0, 0, None, "cfg", 4, "exact", "png")


class Ranks:
    """Records the batches handed out; never answers by itself."""

    def __init__(self):
        self.sent: list[tuple[str, ...]] = []
        self.served_count = 0

    def send(self, batch, asked: bool) -> None:
        self.sent.append(batch.ids)

    def served(self) -> None:
        self.served_count += 1


def _request(name: str, **changes) -> Request:
    return dataclasses.replace(BASE, id=name, **changes)


def _drawn(count: int) -> list[Drawn]:
    return [Drawn([b"png"], "cfg", 1.0, 0.0, "asked") for _ in range(count)]


async def _scheduler(**settings) -> tuple[Scheduler, Ranks, list[str]]:
    scheduler, ranks, stopped = Scheduler(ServeSettings(model="m", nproc=2, **settings)), Ranks(), []
    scheduler.attach(ranks, asyncio.get_running_loop(), lambda: stopped.append("stopped"))
    scheduler._ready(CARD)
    return scheduler, ranks, stopped


def test_each_request_is_answered_once_and_a_late_result_is_dropped():
    async def scenario():
        scheduler, ranks, _ = await _scheduler(request_timeout_s=0.3, max_queue=2)
        running, waiting = scheduler.accept(_request("a"), False), scheduler.accept(_request("b"), False)
        assert ranks.sent == [("a",)], "one batch with the ranks at a time"
        with pytest.raises(ApiError) as queued:
            await scheduler.reply(waiting)
        with pytest.raises(ApiError) as drawing:
            await scheduler.reply(running)
        scheduler._done(("a",), _drawn(1))  # after its deadline: dropped, not a second reply
        assert (queued.value.status, drawing.value.status) == (504, 504)
        assert "without starting" in queued.value.message and "still being drawn" in drawing.value.message
        assert ranks.sent == [("a",)], "a request past its deadline never starts"
        assert scheduler.metrics.requests["timeout"] == 2 and scheduler.metrics.requests["ok"] == 0

    asyncio.run(scenario())


def test_a_full_queue_answers_429_with_retry_after():
    async def scenario():
        scheduler, _, _ = await _scheduler(max_queue=1)
        scheduler.accept(_request("a"), False)  # with the ranks
        scheduler.accept(_request("b"), False)  # queued
        with pytest.raises(ApiError) as full:
            scheduler.accept(_request("c"), False)
        assert full.value.status == 429 and int(full.value.headers["Retry-After"]) >= 1

    asyncio.run(scenario())


def test_a_client_that_leaves_before_its_request_starts_is_dropped():
    async def scenario():
        scheduler, ranks, _ = await _scheduler()
        running, left = scheduler.accept(_request("a"), False), scheduler.accept(_request("b"), False)

        async def gone() -> bool:
            return True

        assert await scheduler.reply(left, gone) is None
        scheduler._done(("a",), _drawn(1))
        assert (await scheduler.reply(running)).strategy == "cfg"
        assert ranks.sent == [("a",)] and scheduler.metrics.requests["cancelled"] == 1

    asyncio.run(scenario())


def test_queued_requests_of_one_shape_share_a_call():
    async def scenario():
        scheduler, ranks, _ = await _scheduler(max_batch=3)
        for name in "ab":
            scheduler.accept(_request(name), False)
        scheduler.accept(_request("c", height=128), False)  # another shape: a call of its own
        for name in "de":
            scheduler.accept(_request(name), False)
        scheduler._done(("a",), _drawn(1))
        assert ranks.sent == [("a",), ("b", "d", "e")]
        scheduler._done(("b", "d", "e"), _drawn(3))
        assert ranks.sent[-1] == ("c",) and ranks.served_count == 2

    asyncio.run(scenario())


def test_a_lost_rank_answers_the_batch_503_and_the_queue_waits_for_the_restart():
    async def scenario():
        scheduler, ranks, stopped = await _scheduler()
        running, waiting = scheduler.accept(_request("a"), False), scheduler.accept(_request("b"), False)
        scheduler._lost("rank 1 (pid 7) was killed by SIGKILL")
        with pytest.raises(ApiError) as lost:
            await scheduler.reply(running)
        assert lost.value.status == 503 and "rank 1 (pid 7) was killed" in lost.value.message
        assert scheduler.health == "restarting" and ranks.sent == [("a",)]
        scheduler._ready(CARD)
        assert ranks.sent == [("a",), ("b",)] and scheduler.health == "ready"
        scheduler._failed("gave up after 3 restarts in a row")
        with pytest.raises(ApiError) as failed:
            await scheduler.reply(waiting)
        assert failed.value.status == 503 and scheduler.health == "failed" and stopped == ["stopped"]
        with pytest.raises(ApiError):
            scheduler.model_card()

    asyncio.run(scenario())
