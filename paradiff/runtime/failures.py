"""A transfer that failed because a peer died or froze, raised again as a :class:`PeerFailure` that says who.

gloo and NCCL report a lost peer as a bare ``RuntimeError`` ("Connection closed by peer", "Operation
timed out!") naming no rank and no operation. :func:`peer_failure` names the operation, the step, the
peers the heartbeats (:mod:`paradiff.runtime.liveness`) show silent and the timeout that bounded the wait.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..errors import PeerFailure
from .liveness import WATCH_S, silent_ranks

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


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _are(ranks: list[int]) -> str:
    return f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'}"


def peer_failure(error: BaseException, operation: str, peers: list[int], timeout: timedelta) -> PeerFailure:
    """The :class:`PeerFailure` for ``error``, raised by ``operation`` (e.g. "the all-gather at step 7") with the
    global ``peers``; watches their heartbeats for a few seconds to tell which are gone."""
    text = str(error).lower()
    closed = any(word in text for word in CLOSED) and not any(word in text for word in TIMED_OUT)
    limit = f"timeout_s={timeout.total_seconds():g}"
    silent = silent_ranks(peers)
    if silent:
        how = "died (its connection closed)" if closed else f"stopped responding (no sign of life for {WATCH_S:g} s)"
        return PeerFailure(
            f"{_ranks(silent)} {how} during {operation}; this rank waited up to {limit}. "
            f"See {_ranks(silent)}'s own output for why, then restart every rank"
        )
    if silent == []:
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
