"""The communication layer every strategy uses.

Two exchange shapes cover the displaced layers:

* :class:`SlotExchange` all-gathers one equal piece per rank (K/V of a band, GroupNorm statistics).
* :class:`NeighbourExchange` swaps boundary rows with the two neighbouring bands by point-to-point
  messages (convolution halos, partial-context K/V).

On a synchronous (warm-up) step a layer sends this step's data and waits for it: exact, one
collective per layer, since each layer's input depends on the previous layer's output.

On a displaced step nothing a layer sends is needed before the next step, and two kinds of piece
travel differently (``Communicator.bucket_limit_bytes`` separates them):

* large pieces (K/V of a band) are sent on their own, asynchronously, on a background process group
  as soon as the layer has them, double-buffered: the transfer has a whole step to finish behind the
  compute, and the foreground group (warm-up exchanges, the output gather) never queues behind it;
* small pieces (GroupNorm statistics, halo rows, small K/V) are packed into one
  :class:`DisplacedBucket` per denoiser call: its layout is recorded on the first displaced call,
  buffers are preallocated from then on, and at the end of the call one all-gather plus one pair of
  neighbour messages carry them all. A hundred or more tiny collectives per step become three, which
  matters: launching a small collective costs about a millisecond of CPU on an oversubscribed host
  (measured with gloo).

A pipeline of stages (``pipefusion``, :mod:`paradiff.stages.link`) passes activations from
one stage to the next instead; it also records how long each of its denoiser calls took and how much
of that it spent idle, waiting for another stage (its pipeline's bubble).

Waits and bytes are counted per step and kind.

gloo moves host memory only. On a gloo group, every transfer of a CUDA tensor goes through a (pinned) host
copy: the tensor is copied to the host when the transfer starts, and what arrives is copied onto the
device when the transfer is waited for (:class:`HostStaging`). Several ranks can so share one GPU, and
a machine without NCCL still runs every strategy; ``PARADIFF_STAGE_HOST=1`` stages CPU tensors through
separate host buffers too, which checks the path on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .distributed import RankGroup
from .failures import is_transport_failure, peer_failure
from .step_state import StepState

#: A layer waited for this step's data from other ranks (warm-up, or a re-plan after a shape change).
SYNC = "sync"
#: A layer used last step's data and launched this step's transfer in the background.
STALE = "stale"
#: The end-of-step all-gather of the denoiser's output bands (always synchronous).
OUTPUT = "output"
#: The all-gather of the two batch halves' outputs of a CFG split (always synchronous).
CFG = "cfg"
#: Activations passed from one pipeline stage to the next (pipefusion).
PIPE = "pipe"
#: The sums of a per-step measure gathered from the ranks that each hold part of it (``runtime.shared_measure``).
MEASURE = "measure"


@dataclass
class StepCounters:
    exchanges: int = 0
    bytes_sent: int = 0
    wait_s: float = 0.0


@dataclass
class CallTime:
    """Seconds spent in the denoiser calls of one step, and the part of them spent waiting for another stage."""

    seconds: float = 0.0
    idle_s: float = 0.0


@dataclass
class FlowCounters:
    """How a pipeline of stages flowed from call to call (``pipefusion``): the denoiser calls during which this rank
    computed patches of the next call, how many, and why the pipeline drained instead (None: it never had to)."""

    calls_flowing: int = 0
    patches_ahead: int = 0
    stopped: str | None = None


@dataclass
class CommStats:
    """Counters per ``(step, kind)``, and per-step call times of pipelined calls; reset at each ``pipe(...)`` call."""

    per_step: dict[tuple[int, str], StepCounters] = field(default_factory=lambda: defaultdict(StepCounters))
    call_times: dict[int, CallTime] = field(default_factory=lambda: defaultdict(CallTime))
    flow: FlowCounters | None = None
    #: What the staleness guard decided (``runtime.staleness.GuardCounters``); None without a guard.
    guard: object | None = None

    def flow_record(self) -> FlowCounters:
        """The flow counters of this call (made on first use)."""
        if self.flow is None:
            self.flow = FlowCounters()
        return self.flow

    def record(self, step: int, kind: str, nbytes: int, wait_s: float = 0.0, exchanges: int = 1) -> None:
        """Add ``exchanges`` layer exchanges (or transfers of the output), bytes sent and seconds blocked."""
        counters = self.per_step[(step, kind)]
        counters.exchanges += exchanges
        counters.bytes_sent += nbytes
        counters.wait_s += wait_s

    def record_call(self, step: int, seconds: float, idle_s: float) -> None:
        """A pipelined denoiser call took ``seconds``, ``idle_s`` of them waiting for another stage."""
        times = self.call_times[step]
        times.seconds += seconds
        times.idle_s += idle_s

    def reset(self) -> None:
        self.per_step.clear()
        self.call_times.clear()
        self.flow = self.guard = None

    @classmethod
    def combined(cls, *parts: CommStats) -> CommStats:
        """One set of counters from several communicators of one model (same step numbering)."""
        out = cls()
        for part in parts:
            for (step, kind), c in part.per_step.items():
                out.record(step, kind, c.bytes_sent, c.wait_s, c.exchanges)
            for step, times in part.call_times.items():
                out.record_call(step, times.seconds, times.idle_s)
            out.flow = out.flow or part.flow
            out.guard = out.guard or part.guard
        return out

    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.per_step})

    def count(self, step: int, kind: str) -> int:
        return self.per_step[(step, kind)].exchanges if (step, kind) in self.per_step else 0

    def total(self, kind: str | None = None) -> StepCounters:
        out = StepCounters()
        for (_, k), c in self.per_step.items():
            if kind is None or k == kind:
                out.exchanges += c.exchanges
                out.bytes_sent += c.bytes_sent
                out.wait_s += c.wait_s
        return out

    def summary(self) -> dict:
        """Totals and per-step rows; with pipelined calls also ``idle_share``: the share of the denoiser
        calls' time this rank waited for another stage (the pipeline's bubble), overall and per step, and
        ``flow`` (:class:`FlowCounters`, as a dict)."""
        steps = self.steps()
        total = self.total()
        summary = {
            "steps": len(steps),
            "bytes_per_step": total.bytes_sent / max(len(steps), 1),
            "wait_s": total.wait_s,
            "sync_layer_exchanges": self.total(SYNC).exchanges,
            "stale_layer_exchanges": self.total(STALE).exchanges,
            "cfg_gathers": self.total(CFG).exchanges,
            "stage_transfers": self.total(PIPE).exchanges,
            "measure_agreements": self.total(MEASURE).exchanges,
            "per_step": [
                {
                    "step": step,
                    "sync_layer_exchanges": self.count(step, SYNC),
                    "stale_layer_exchanges": self.count(step, STALE),
                    "stage_transfers": self.count(step, PIPE),
                    "bytes_sent": sum(c.bytes_sent for (s, _), c in self.per_step.items() if s == step),
                    "wait_s": sum(c.wait_s for (s, _), c in self.per_step.items() if s == step),
                }
                for step in steps
            ],
        }
        if self.call_times:
            seconds = sum(t.seconds for t in self.call_times.values())
            summary["idle_share"] = sum(t.idle_s for t in self.call_times.values()) / max(seconds, 1e-12)
            for row in summary["per_step"]:
                times = self.call_times.get(row["step"])
                if times is not None:
                    row["idle_share"] = times.idle_s / max(times.seconds, 1e-12)
        if self.flow is not None:
            summary["flow"] = dataclasses.asdict(self.flow)
        if self.guard is not None:
            summary["guard"] = dataclasses.asdict(self.guard)
        return summary


@dataclass(frozen=True)
class Transfer:
    """A transfer in flight: torch's work handle, and what it is and with whom, for the error if it fails."""

    work: object
    #: e.g. "the all-gather", "the send to rank 1" (ranks within the group).
    operation: str
    #: The other ranks it exchanges with, numbered within the group.
    peers: tuple[int, ...]


#: Default of ``Communicator.bucket_limit_bytes``.
BUCKET_LIMIT_BYTES = 256 * 1024
#: Set to 1 to stage CPU tensors through separate host buffers as CUDA tensors are on gloo.
STAGE_HOST_VARIABLE = "PARADIFF_STAGE_HOST"


class HostStaging:
    """The host copies of one transfer's tensors, for a process group that moves host memory only.

    ``outgoing`` returns what to send (a host copy, made now), ``incoming`` what to receive into (a host
    buffer, copied into the tensor when the transfer is waited for), ``both`` a host copy that is sent and
    received into (broadcast, all-reduce). Tensors that need no staging pass through unchanged.
    """

    def __init__(self, active: bool, every_tensor: bool):
        self.active, self.every_tensor = active, every_tensor
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kept: list[torch.Tensor] = []

    def _stages(self, tensor: torch.Tensor) -> bool:
        return self.active and (self.every_tensor or tensor.device.type != "cpu")

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.device.type == "cuda"
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)

    def outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._stages(tensor):
            return tensor
        host = self._host(tensor)
        host.copy_(tensor)
        self.kept.append(host)
        return host

    def incoming(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or not self._stages(tensor):
            return tensor
        host = self._host(tensor)
        self.copies.append((tensor, host))
        return host

    def both(self, tensor: torch.Tensor) -> torch.Tensor:
        host = self.outgoing(tensor)
        if host is not tensor:
            self.copies.append((tensor, host))
        return host

    def wrap(self, work):
        """``work``, or a work whose ``wait`` also copies what arrived onto the tensors' devices."""
        return _StagedWork(work, self.copies, self.kept) if self.copies or self.kept else work


class _StagedWork:
    """A transfer between host copies: waiting for it copies what it received back to where the caller wants it."""

    def __init__(self, work, copies: list[tuple[torch.Tensor, torch.Tensor]], kept: list[torch.Tensor]):
        self.work, self.copies, self.kept = work, copies, kept

    def wait(self, timeout=None) -> bool:
        self.work.wait(timeout)
        for tensor, host in self.copies:
            tensor.copy_(host)
        self.copies, self.kept = [], []
        return True


class Communicator:
    """A rank group plus the step state and counters that every exchange of one model shares.

    Every transfer paradiff makes goes through one of these: it reserves message tags (the same on every
    rank, because ranks reserve them in the same order), launches the point-to-point messages and
    collectives on the foreground or background group, bounds every wait by the group's timeout, and
    counts bytes and waits per step and kind. Ranks are numbered within the group.
    """

    def __init__(self, ranks: RankGroup, state: StepState):
        self.ranks = ranks
        self.state = state
        #: Displaced pieces at least this large are sent on their own as soon as a layer produces them,
        #: so the transfer has a whole step to finish behind the compute; smaller ones are bucketed
        #: (the patch strategy's ``bucket_limit_bytes`` option sets it).
        self.bucket_limit_bytes = BUCKET_LIMIT_BYTES
        self.stats = CommStats()
        #: gloo moves host memory only: CUDA tensors (and with ``PARADIFF_STAGE_HOST=1`` every tensor) go
        #: through host copies.
        self.stages_through_host = dist.get_backend(ranks.group) == "gloo"
        self.stages_every_tensor = os.environ.get(STAGE_HOST_VARIABLE) == "1"

    @property
    def size(self) -> int:
        return self.ranks.size

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def device(self) -> torch.device:
        """Where this group's collectives want their tensors: the current CUDA device for NCCL, else the CPU."""
        if dist.get_backend(self.ranks.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def tags(self, count: int, lasting: bool = False) -> range:
        """``count`` message tags no other link on this group is using, the same on every rank.

        ``lasting``: a layer's own tags for as long as the strategy is installed (reserve them at install
        time); otherwise tags for one call's messages (:class:`~paradiff.runtime.distributed.TagCounter`).
        """
        return self.ranks.tags.reserve(count, lasting)

    def record(self, kind: str, nbytes: int = 0, wait_s: float = 0.0, exchanges: int = 1, step: int | None = None):
        """Count ``exchanges`` exchanges of ``kind``, the bytes this rank sent and the seconds it was blocked."""
        self.stats.record(self.state.step if step is None else step, kind, nbytes, wait_s, exchanges)

    def wait(self, transfers: list[Transfer]) -> float:
        """Wait for ``transfers`` (each bounded by the group's timeout); returns the seconds spent blocked.

        A transfer that fails because a peer died or froze raises :class:`~paradiff.errors.PeerFailure`.
        """
        start = time.perf_counter()
        for transfer in transfers:
            with self.failures_named(transfer.operation, transfer.peers):
                transfer.work.wait(self.ranks.timeout)
        return time.perf_counter() - start

    @contextmanager
    def failures_named(self, operation: str, peers: tuple[int, ...] | None = None) -> Iterator[None]:
        """Raise a transport's failure inside the block again as a ``PeerFailure`` naming ``operation``, the
        step, the peers (ranks within the group; default: all others) and the timeout."""
        try:
            yield
        except Exception as error:
            if not is_transport_failure(error):
                raise
            others = [rank for rank in range(self.size) if rank != self.rank] if peers is None else peers
            step = self.state.step
            where = f"{operation} at step {step}" if step >= 0 else f"{operation} before the first step"
            global_peers = [self.ranks.global_rank(rank) for rank in others]
            raise peer_failure(error, where, global_peers, self.ranks.timeout) from error

    def _launch(self, operation: str, peers: tuple[int, ...] | None, start: Callable[[], object]) -> Transfer:
        with self.failures_named(operation, peers):
            work = start()
        others = tuple(rank for rank in range(self.size) if rank != self.rank) if peers is None else peers
        return Transfer(work, operation, others)

    def _group(self, background: bool) -> dist.ProcessGroup:
        return self.ranks.background if background else self.ranks.group

    def staging(self) -> HostStaging:
        """Host copies for one transfer's tensors (none unless the group is gloo)."""
        return HostStaging(self.stages_through_host, self.stages_every_tensor)

    def send(self, tensor: torch.Tensor, to: int, tag: int, background: bool = False) -> tuple[Transfer, int]:
        """Start sending ``tensor`` (contiguous, kept alive by the caller until sent) to rank ``to``; (transfer,
        bytes)."""
        peer, group, staging = self.ranks.global_rank(to), self._group(background), self.staging()
        sent = staging.outgoing(tensor)
        transfer = self._launch(
            f"the send to rank {peer}", (to,), lambda: staging.wrap(dist.isend(sent, peer, group, tag=tag))
        )
        return transfer, tensor_bytes(tensor)

    def receive(self, buffer: torch.Tensor, source: int, tag: int, background: bool = False) -> Transfer:
        """Start receiving rank ``source``'s message ``tag`` into ``buffer``; the transfer."""
        peer, group, staging = self.ranks.global_rank(source), self._group(background), self.staging()
        into = staging.incoming(buffer)
        return self._launch(
            f"the receive from rank {peer}", (source,), lambda: staging.wrap(dist.irecv(into, peer, group, tag=tag))
        )

    def broadcast(self, tensor: torch.Tensor, source: int, background: bool = False) -> tuple[Transfer, int]:
        """Start overwriting ``tensor`` (contiguous) with rank ``source``'s; (transfer, bytes this rank sent)."""
        peer, group, staging = self.ranks.global_rank(source), self._group(background), self.staging()
        peers = None if self.rank == source else (source,)
        host = staging.both(tensor)
        transfer = self._launch(
            f"the broadcast from rank {peer}",
            peers,
            lambda: staging.wrap(dist.broadcast(host, peer, group=group, async_op=True)),
        )
        return transfer, (tensor_bytes(tensor) * (self.size - 1) if self.rank == source else 0)

    def all_gather(self, pieces: list[torch.Tensor], tensor: torch.Tensor, background: bool = False):
        """Start gathering every rank's ``tensor`` into ``pieces``; (transfer, bytes this rank sent)."""
        group, staging = self._group(background), self.staging()
        sent, into = staging.outgoing(tensor), [staging.incoming(piece) for piece in pieces]
        transfer = self._launch(
            "the all-gather", None, lambda: staging.wrap(dist.all_gather(into, sent, group, async_op=True))
        )
        return transfer, tensor_bytes(tensor) * (self.size - 1)

    def all_gather_object(self, value) -> list:
        """Every rank's picklable ``value``, in rank order (waited for now)."""
        values: list = [None] * self.size
        with self.failures_named("the all-gather of objects"):
            dist.all_gather_object(values, value, group=self.ranks.group)
        return values

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` over the ranks in place (a sum unless ``op`` says otherwise; waited for now)."""
        group, staging = self.ranks.group, self.staging()
        host = staging.both(tensor)
        self.wait(
            [
                self._launch(
                    "the all-reduce",
                    None,
                    lambda: staging.wrap(dist.all_reduce(host, op=op, group=group, async_op=True)),
                )
            ]
        )
        return tensor

    def swap_with_neighbours(self, send: tuple, receive: tuple, tags: tuple[int, int], background: bool = False):
        """Send ``send = (to_above, to_below)`` and receive ``receive = (from_above, from_below)``.

        Rows go up with ``tags[0]`` and down with ``tags[1]``; the band at an image border skips the side
        it has no neighbour on. Returns the works and the bytes this rank sent.
        """
        (to_above, to_below), (from_above, from_below) = send, receive
        group, ops, stagings, neighbours, nbytes = self._group(background), [], [], (), 0

        def add(op, tensor: torch.Tensor, peer: int, tag: int) -> None:
            staging = self.staging()
            staged = staging.outgoing(tensor) if op is dist.isend else staging.incoming(tensor)
            ops.append(dist.P2POp(op, staged, peer, group, tag))
            stagings.append(staging)

        if self.rank > 0:
            peer = self.ranks.global_rank(self.rank - 1)
            add(dist.isend, to_above, peer, tags[0])
            add(dist.irecv, from_above, peer, tags[1])
            neighbours, nbytes = (*neighbours, self.rank - 1), nbytes + tensor_bytes(to_above)
        if self.rank < self.size - 1:
            peer = self.ranks.global_rank(self.rank + 1)
            add(dist.isend, to_below, peer, tags[1])
            add(dist.irecv, from_below, peer, tags[0])
            neighbours, nbytes = (*neighbours, self.rank + 1), nbytes + tensor_bytes(to_below)
        if not ops:
            return [], nbytes
        operation = "the swap of boundary rows with the neighbouring bands"
        with self.failures_named(operation, neighbours):
            works = dist.batch_isend_irecv(ops)
        if not self.stages_through_host:  # NCCL may answer the whole batch with one work
            return [Transfer(work, operation, neighbours) for work in works], nbytes
        return [
            Transfer(staging.wrap(work), operation, neighbours) for staging, work in zip(stagings, works, strict=True)
        ], nbytes

    def bucket(self) -> DisplacedBucket:
        """The displaced-transfer bucket of the current call context and call slot."""
        return self.state.exchange("paradiff.bucket", lambda: DisplacedBucket(self))

    def end_call(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """End of a denoiser call: gather the output bands, then send this call's displaced data."""
        output = self.all_gather_output(local, dim)
        self.bucket().flush()
        return output

    def all_gather_output(self, local: torch.Tensor, dim: int, kind: str = OUTPUT) -> torch.Tensor:
        """Synchronously gather every rank's piece of the denoiser output and concatenate along ``dim``."""
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(self.size)]
        work, nbytes = self.all_gather(pieces, local)
        self.record(kind, nbytes, self.wait([work]))
        return torch.cat(pieces, dim=dim)


class DisplacedBucket:
    """Every layer's displaced data of one denoiser call, sent as one transfer per channel.

    Channels: ``all`` (every rank receives the piece: K/V, GroupNorm statistics), ``up`` (sent to the
    band above: top rows) and ``down`` (sent to the band below: bottom rows). Send buffers are filled
    in place; receive buffers are read through views during the next call. One buffer per channel and
    dtype suffices: the next call waits for the transfer before its first write, and the next
    transfer starts only after every read of this one (on CUDA the collective's stream also waits for
    the kernels already queued).
    """

    def __init__(self, comm: Communicator):
        self.comm, self.tags = comm, tuple(comm.tags(2))
        self.layout: dict[tuple[str, str], tuple[torch.dtype, int, torch.Size]] | None = None
        self.recording: dict[tuple[str, str], torch.Tensor] = {}
        self.send: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.recv: dict[tuple[str, torch.dtype], list[torch.Tensor | None]] = {}
        self.delivered: set[tuple[str, str]] = set()
        self.in_flight: set[tuple[str, str]] = set()
        self.pending: list = []

    def holds(self, channel: str, key: str) -> bool:
        """Whether a piece of ``key`` can go into this bucket: while its layout is recorded, or if it is in it."""
        return self.layout is None or (channel, key) in self.layout

    def put(self, channel: str, key: str, tensor: torch.Tensor) -> None:
        if self.layout is None:
            self.recording[(channel, key)] = tensor.detach().clone()
            return
        dtype, offset, shape = self.layout[(channel, key)]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise RuntimeError(f"displaced piece {key} changed from {tuple(shape)} to {tuple(tensor.shape)} mid-run")
        self.send[(channel, dtype)][offset : offset + tensor.numel()].view(shape).copy_(tensor)
        self.in_flight.add((channel, key))

    def received(self, channel: str, key: str) -> list[torch.Tensor | None] | None:
        """Per-source views of ``key``'s piece from the last transfer, or None if it carried none.

        ``all``: one view per rank. ``up``/``down``: ``[from the band below]`` / ``[from the band above]``.
        """
        if (channel, key) not in self.delivered:
            return None
        if self.pending:
            self.comm.record(STALE, wait_s=self.comm.wait(self.pending), exchanges=0)
            self.pending = []
        dtype, offset, shape = self.layout[(channel, key)]
        return [
            None if buffer is None else buffer[offset : offset + shape.numel()].view(shape)
            for buffer in self.recv[(channel, dtype)]
        ]

    def flush(self) -> None:
        """Launch this call's transfers (asynchronously) if any layer put displaced data."""
        if self.layout is None and self.recording:
            self._freeze_layout()
        if not self.in_flight:  # a call in sync (warm-up, or refreshed): the next displaced call reads what it left
            self.delivered = set()
            return
        self.drain()
        comm, nbytes = self.comm, 0
        for (channel, dtype), send in self.send.items():
            if channel == "all":
                work, sent = comm.all_gather(self.recv[(channel, dtype)], send, background=True)
                self.pending.append(work)
                nbytes += sent
            elif channel == "up":
                # rows going up come from the band below; rows going down from the band above
                down = self.send[("down", dtype)]
                receive = (self.recv[("down", dtype)][0], self.recv[("up", dtype)][0])
                works, sent = comm.swap_with_neighbours((send, down), receive, self.tags, background=True)
                self.pending += works
                nbytes += sent
        comm.record(STALE, nbytes, exchanges=0)
        self.delivered, self.in_flight = self.in_flight, set()

    def drain(self) -> None:
        if self.pending:
            self.comm.wait(self.pending)
            self.pending = []

    def _freeze_layout(self) -> None:
        sizes: dict[tuple[str, torch.dtype], int] = {}
        self.layout = {}
        for (channel, key), tensor in self.recording.items():
            offset = sizes.get((channel, tensor.dtype), 0)
            self.layout[(channel, key)] = (tensor.dtype, offset, tensor.shape)
            sizes[(channel, tensor.dtype)] = offset + tensor.numel()
        device = next(iter(self.recording.values())).device
        for (channel, dtype), numel in sizes.items():
            self.send[(channel, dtype)] = torch.empty(numel, dtype=dtype, device=device)
            sources = self.comm.size if channel == "all" else 1
            self.recv[(channel, dtype)] = [torch.empty(numel, dtype=dtype, device=device) for _ in range(sources)]
        recorded, self.recording = self.recording, {}
        for (channel, key), tensor in recorded.items():
            self.put(channel, key, tensor)


class _LayerExchange:
    """What a layer's exchange does on each kind of step; subclasses say how pieces travel.

    * synchronous: launch on the foreground group and wait (this step's data, exact);
    * displaced, large piece: return what the previous step's transfer brought (waiting for it only if
      it is still in flight), then launch this step's transfer on the background group into the
      other buffer (double-buffered: the buffer being read is never the one being written);
    * displaced, small piece: return what the previous call's bucket brought, put this step's piece
      into this call's bucket; a layer the bucket's recorded layout lacks (a step cache skipped it on the
      call that recorded it) sends its piece on its own, as a large one.
    """

    #: The bucket channels its pieces travel in.
    channels: tuple[str, ...] = ()

    def __init__(self, comm: Communicator, key: str):
        self.comm, self.key = comm, key
        self.latest = None
        self.spare = None
        self.pending: list = []

    def _run(self, parts: tuple[torch.Tensor, ...], synchronous: bool, initial=None):
        comm = self.comm
        if synchronous or (self.latest is None and initial is None):
            self.drain()
            parts = tuple(p.contiguous() for p in parts)
            received, works, nbytes = self._launch(parts, False, None)
            comm.record(SYNC, nbytes, comm.wait(works))
            self.latest = received
            return received
        bucket = comm.bucket()
        in_layout = all(bucket.holds(channel, self.key) for channel in self.channels)
        if sum(tensor_bytes(p) for p in parts) >= comm.bucket_limit_bytes or not in_layout:
            wait_s = self.drain()
            stale = self.latest if self.latest is not None else initial()
            reuse = self.spare if self.latest is not None else None
            parts = tuple(p.contiguous() for p in parts)
            received, self.pending, nbytes = self._launch(parts, True, reuse)
            self.spare, self.latest = (stale if self.latest is not None else None), received
            comm.record(STALE, nbytes, wait_s)
            return stale
        stale = self._from_bucket(bucket)
        if stale is None:
            stale = self.latest if self.latest is not None else initial()
        self._put(bucket, parts)
        comm.record(STALE)
        return stale

    def drain(self) -> float:
        if not self.pending:
            return 0.0
        wait_s = self.comm.wait(self.pending)
        self.pending = []
        return wait_s

    def _launch(self, parts, background: bool, reuse):
        """Start sending ``parts`` (on the background group if ``background``); (receive buffers, works, bytes sent)."""
        raise NotImplementedError

    def _from_bucket(self, bucket: DisplacedBucket):
        raise NotImplementedError

    def _put(self, bucket: DisplacedBucket, parts) -> None:
        raise NotImplementedError


class SlotExchange(_LayerExchange):
    """One layer's all-gather of an equal-sized piece per rank."""

    channels = ("all",)

    def gather(self, local: torch.Tensor, synchronous: bool) -> list[torch.Tensor]:
        """Every rank's piece: this step's if ``synchronous``, else the previous step's (own slot included).

        Callers replace their own slot with ``local`` and must not write into the returned tensors.
        """
        return self._run((local,), synchronous)

    def _launch(self, parts, background, reuse):
        (local,) = parts
        if reuse is None or reuse[0].dtype != local.dtype:  # a warm-up step's buffers are wider than a narrowed piece
            reuse = [torch.empty_like(local) for _ in range(self.comm.size)]
        slots = reuse
        work, nbytes = self.comm.all_gather(slots, local, background)
        return slots, [work], nbytes

    def _from_bucket(self, bucket):
        return bucket.received("all", self.key)

    def _put(self, bucket, parts):
        bucket.put("all", self.key, parts[0])


class NeighbourExchange(_LayerExchange):
    """One layer's swap of boundary rows with the bands above and below (point-to-point).

    ``exchange(top, bottom)`` sends ``top`` to the band above and ``bottom`` to the band below, and
    returns ``(from_above, from_below)``: the band above's bottom rows and the band below's top rows
    (``None`` at the image border).
    """

    channels = ("up", "down")

    def __init__(self, comm: Communicator, key: str, tag: int):
        super().__init__(comm, key)
        self.tag = tag  # reserved by the layer at install time (a fixed tag per layer, the same on every rank)

    def exchange(
        self,
        top: torch.Tensor,
        bottom: torch.Tensor,
        synchronous: bool,
        initial: Callable[[], tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``initial`` supplies last step's rows when this exchange has not run before (e.g. after a
        warm-up that gathered everything another way), so a displaced step never waits."""
        return self._run((top, bottom), synchronous, initial)

    def _launch(self, parts, background, reuse):
        top, bottom = parts
        rank, size = self.comm.rank, self.comm.size
        above, below = reuse if reuse is not None else (None, None)
        above = above if above is not None or rank == 0 else torch.empty_like(top)
        below = below if below is not None or rank == size - 1 else torch.empty_like(bottom)
        works, nbytes = self.comm.swap_with_neighbours((top, bottom), (above, below), (self.tag, self.tag), background)
        return (above, below), works, nbytes

    def _from_bucket(self, bucket):
        from_below, from_above = bucket.received("up", self.key), bucket.received("down", self.key)
        if from_below is None:
            return None
        rank, size = self.comm.rank, self.comm.size
        return (from_above[0] if rank > 0 else None, from_below[0] if rank < size - 1 else None)

    def _put(self, bucket, parts):
        bucket.put("up", self.key, parts[0])
        bucket.put("down", self.key, parts[1])


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a transfer of ``tensor`` moves."""
    return tensor.numel() * tensor.element_size()
