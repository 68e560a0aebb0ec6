"""Point-to-point transfers of unit outputs between the components of a cut denoiser (``asyncdiff``).

On a displaced call a rank sends each of its units' outputs that a later component reads (the last
unit's output to the next component, U-Net skip features to the components whose up blocks read them)
as soon as the unit has run, and posts at the start of the call the receives of what the earlier
components send during the same call. Those arrive behind the compute and are read one call later
(double-buffered: the buffers read in this call are not the ones being written). Messages between a
pair of ranks are posted in unit order on both sides, which is what NCCL (which ignores tags) needs.

The noise prediction of the last component goes to every rank with one broadcast per displaced call;
with stride 2 the last component's look-ahead prediction (for the next step) is broadcast without
waiting and read by the next call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import OUTPUT, PIPE, Communicator

#: Tags of one link's messages: ``tag_base + unit × TAGS_PER_UNIT + leaf``.
TAGS_PER_UNIT = 64


class ComponentLink:
    """One call context and call slot's transfers of unit outputs and of the noise prediction."""

    def __init__(self, comm: Communicator, tag_base: int):
        self.comm, self.tag_base = comm, tag_base
        self.sends: list[tuple[object, torch.Tensor]] = []
        #: Receives posted in this call (read by the next displaced call), and those read now, by unit.
        self.posted: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self.inbox: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self.spare: dict[int, list[torch.Tensor]] = {}
        self.ahead: tuple[object, torch.Tensor, int] | None = None

    def post_receives(self, sources: dict[int, int], templates: dict[int, list[torch.Tensor]]) -> None:
        """Start receiving this call's output of each unit of ``sources`` (unit → its rank), shaped as ``templates``."""
        self.drain_receives()
        group = self.comm.ranks
        self.inbox, posted = self.posted, {}
        for unit in sorted(sources):
            buffers = self.spare.pop(unit, None) or [torch.empty_like(t) for t in templates[unit]]
            peer = group.global_rank(sources[unit])
            works = [
                dist.irecv(buffer, peer, group=group.background, tag=self._tag(unit, leaf))
                for leaf, buffer in enumerate(buffers)
            ]
            posted[unit] = (works, buffers)
        self.posted = posted

    def received(self, unit: int) -> list[torch.Tensor] | None:
        """What the previous displaced call brought of ``unit``'s output (waiting for it if needed); None if nothing."""
        if unit not in self.inbox:
            return None
        works, buffers = self.inbox.pop(unit)
        self.comm.stats.record(self.comm.state.step, PIPE, 0, self.comm.wait(works), exchanges=0)
        self.spare[unit] = buffers  # written again only by the receive posted at the next call
        return buffers

    def send(self, unit: int, tensors: list[torch.Tensor], targets: list[int]) -> None:
        """Start sending ``unit``'s output tensors to the ranks ``targets`` (kept alive until sent)."""
        group, nbytes = self.comm.ranks, 0
        for leaf, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            for target in targets:
                work = dist.isend(tensor, group.global_rank(target), group=group.background, tag=self._tag(unit, leaf))
                self.sends.append((work, tensor))
                nbytes += tensor.numel() * tensor.element_size()
        self.comm.stats.record(self.comm.state.step, PIPE, nbytes, exchanges=len(tensors) * len(targets))

    def share(self, sample: torch.Tensor, source: int) -> torch.Tensor:
        """Rank ``source``'s ``sample`` on every rank (one broadcast, waited for now)."""
        work, buffer = self._broadcast(sample, source)
        self._record_output(buffer, source, self.comm.wait([work]))
        return buffer

    def share_ahead(self, sample: torch.Tensor, source: int) -> None:
        """Start broadcasting rank ``source``'s ``sample`` for the next call to read (:meth:`take_ahead`)."""
        work, buffer = self._broadcast(sample, source)
        self.ahead = (work, buffer, source)

    def take_ahead(self) -> torch.Tensor | None:
        if self.ahead is None:
            return None
        (work, buffer, source), self.ahead = self.ahead, None
        self._record_output(buffer, source, self.comm.wait([work]))
        return buffer

    def drain(self) -> None:
        """Wait for every transfer still in flight (at the end of a ``pipe(...)`` call)."""
        self.drain_sends()
        self.drain_receives()
        for works, _ in self.posted.values():
            self.comm.wait(works)
        self.posted = {}
        if self.ahead is not None:
            self.comm.wait([self.ahead[0]])
            self.ahead = None

    def drain_sends(self) -> None:
        if self.sends:
            self.comm.wait([work for work, _ in self.sends])
            self.sends = []

    def drain_receives(self) -> None:
        """Wait for receives this call did not read (units it skipped), so their buffers can be reused."""
        for unit, (works, buffers) in self.inbox.items():
            self.comm.wait(works)
            self.spare[unit] = buffers
        self.inbox = {}

    def _broadcast(self, sample: torch.Tensor, source: int):
        comm = self.comm
        buffer = sample.contiguous() if comm.rank == source else torch.empty_like(sample)
        work = dist.broadcast(buffer, comm.ranks.global_rank(source), group=comm.ranks.group, async_op=True)
        return work, buffer

    def _record_output(self, buffer: torch.Tensor, source: int, wait_s: float) -> None:
        comm = self.comm
        sent = buffer.numel() * buffer.element_size() * (comm.size - 1) if comm.rank == source else 0
        comm.stats.record(comm.state.step, OUTPUT, sent, wait_s)

    def _tag(self, unit: int, leaf: int) -> int:
        return self.tag_base + unit * TAGS_PER_UNIT + leaf
