"""A transfer that failed because a peer died or froze, raised again as a :class:`PeerFailure` that says who.

gloo and NCCL report a lost peer as a bare ``RuntimeError`` ("Connection closed by peer", "Operation
timed out!") naming no rank and no operation. :func:`peer_failure` names the operation, the step, the
rank lost first (:mod:`paradiff.runtime.liveness`: the same on every rank, whichever transfer failed
there) and the timeout that bounded the wait.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..errors import PeerFailure
from .liveness import DEAD, FROZEN, WATCH_S, Loss, arrive, lost_ranks, mark_left, whereabouts

#: Words of the transports' messages for a connection a peer closed (it exited, crashed or was killed).
CLOSED = ("closed by peer", "connection reset", "broken pipe", "connection refused")
#: Words of the transports' messages for a wait that ran out of time.
TIMED_OUT = ("timed out", "timeout")


def is_transport_failure(error: BaseException) -> bool:
    """Whether ``error`` is a transport's report of a lost or silent peer (not a bug of the caller's)."""
    if isinstance(error, PeerFailure):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in (*CLOSED, *TIMED_OUT))


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _are(ranks: list[int]) -> str:
    return f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'}"


def _phrase(how: str, closed: bool) -> str:
    """How a lost rank is gone: from its process where known, else from what the transport said."""
    if how in (DEAD, FROZEN):
        return how
    return "died (its connection closed)" if closed else f"stopped responding (no sign of life for {WATCH_S:g} s)"


def describe_loss(loss: Loss, closed: bool) -> str:
    """``rank 3 died (its process is gone)``, the ranks grouped by how they were lost, in rank order."""
    groups: dict[str, list[int]] = {}
    for rank, how in zip(loss.ranks, loss.how, strict=True):
        groups.setdefault(_phrase(how, closed), []).append(rank)
    return " and ".join(f"{_ranks(ranks)} {phrase}" for phrase, ranks in groups.items())


def peer_failure(error: BaseException, operation: str, peers: list[int], timeout: timedelta) -> PeerFailure:
    """The :class:`PeerFailure` for ``error``, raised by ``operation`` (e.g. "the all-gather at step 7") with the
    global ``peers``; watches their heartbeats for a few seconds to tell which are gone, unless another rank
    already named the rank lost first. Marks this rank as leaving, so that no other rank blames it."""
    failure = _failure(error, operation, peers, timeout)
    mark_left()
    return failure


def _failure(error: BaseException, operation: str, peers: list[int], timeout: timedelta) -> PeerFailure:
    text = str(error).lower()
    closed = any(word in text for word in CLOSED) and not any(word in text for word in TIMED_OUT)
    limit = f"timeout_s={timeout.total_seconds():g}"
    loss = lost_ranks(peers)
    if loss is not None and loss.ranks:
        me = dist.get_rank() if dist.is_initialized() else -1
        seen = f" (rank {loss.seen_by} saw it first)" if loss.seen_by not in (-1, me) else ""
        return PeerFailure(
            f"{describe_loss(loss, closed)} during {operation}{seen}; this rank waited up to {limit}. "
            f"See {_ranks(loss.ranks)}'s own output for why, then restart every rank"
        )
    if loss is not None:
        if closed:
            return PeerFailure(
                f"{_ranks(peers)} closed the connection during {operation} while still running: an error there "
                "came first; see its output, then restart every rank"
            )
        return PeerFailure(
            f"{operation} got no answer within {limit}, though {_are(peers)} alive: elsewhere in the program (every "
            "rank must make the same calls), or a step takes longer than the timeout (raise timeout_s)"
        )
    how = "connection closed" if closed else f"no answer within {limit}"
    return PeerFailure(
        f"lost contact with {_ranks(peers)} during {operation} ({how}), and the rendezvous store does not answer "
        "either: its host (torchrun's agent or rank 0) is gone. Restart every rank"
    )


def meet_every_rank(where: str, timeout: timedelta) -> None:
    """Wait until every rank has reached ``where`` (e.g. "parallelize()") as often as this one, up to ``timeout``;
    else a :class:`PeerFailure` naming the ranks that have not, and what they are doing (beating elsewhere,
    gone, or never seen). Needs this rank's heartbeat (:func:`~paradiff.runtime.liveness.start_heartbeat`).

    Without it, a rank that never comes makes the others fail inside torch's group creation, with a store's
    "wait timeout" that names no rank.
    """
    try:
        missing = arrive(timeout.total_seconds())
    except Exception as error:  # the store itself is gone
        raise PeerFailure(
            f"the rendezvous store does not answer at {where} ({error}): its host (torchrun's agent or rank 0) is "
            "gone. Restart every rank"
        ) from error
    if not missing:
        return
    found = whereabouts(missing)
    said = {
        "alive": "is running but elsewhere in its program",
        "unseen": "has shown no sign of life to paradiff (still loading, stuck before it, or failed: see its output)",
    }
    parts = [f"rank {rank} {said.get(state) or _phrase(state, closed=False)}" for rank, state in found.items()]
    mark_left()
    raise PeerFailure(
        f"{_ranks(missing)} did not reach {where} within timeout_s={timeout.total_seconds():g}, as this rank did: "
        f"{'; '.join(parts)}. Every rank must call {where} alike; restart every rank"
    )
