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

from .comm import OUTPUT, PIPE, Communicator

#: Most tensors one unit's output may hold (each travels as its own message with its own tag).
TENSORS_PER_UNIT = 64


class ComponentLink:
    """One call context and call slot's transfers of unit outputs and of the noise prediction."""

    def __init__(self, comm: Communicator, units: int):
        #: Message ``(unit, leaf)`` travels with tag ``tags[unit × TENSORS_PER_UNIT + leaf]``.
        self.comm, self.tags = comm, comm.tags(units * TENSORS_PER_UNIT)
        self.sends: list[tuple[object, torch.Tensor]] = []
        #: Receives posted in this call (read by the next displaced call), and those read now, by unit.
        self.posted: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self.inbox: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self.spare: dict[int, list[torch.Tensor]] = {}
        self.ahead: tuple[object, torch.Tensor, int] | None = None

    def post_receives(self, sources: dict[int, int], templates: dict[int, list[torch.Tensor]]) -> None:
        """Start receiving this call's output of each unit of ``sources`` (unit → its rank), shaped as ``templates``."""
        self.drain_receives()
        self.inbox, posted = self.posted, {}
        for unit in sorted(sources):
            buffers = self.spare.pop(unit, None) or [_contiguous_like(t) for t in templates[unit]]
            works = [
                self.comm.receive(buffer, sources[unit], self._tag(unit, leaf), background=True)
                for leaf, buffer in enumerate(buffers)
            ]
            posted[unit] = (works, buffers)
        self.posted = posted

    def received(self, unit: int) -> list[torch.Tensor] | None:
        """What the previous displaced call brought of ``unit``'s output (waiting for it if needed); None if nothing."""
        if unit not in self.inbox:
            return None
        works, buffers = self.inbox.pop(unit)
        self.comm.record(PIPE, wait_s=self.comm.wait(works), exchanges=0)
        self.spare[unit] = buffers  # written again only by the receive posted at the next call
        return buffers

    def send(self, unit: int, tensors: list[torch.Tensor], targets: list[int]) -> None:
        """Start sending ``unit``'s output tensors to the ranks ``targets`` (kept alive until sent)."""
        total = 0
        for leaf, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            for target in targets:
                work, nbytes = self.comm.send(tensor, target, self._tag(unit, leaf), background=True)
                self.sends.append((work, tensor))
                total += nbytes
        self.comm.record(PIPE, total, exchanges=len(tensors) * len(targets))

    def share(self, sample: torch.Tensor, source: int) -> torch.Tensor:
        """Rank ``source``'s ``sample`` on every rank (one broadcast, waited for now)."""
        work, buffer, sent = self._broadcast(sample, source)
        self.comm.record(OUTPUT, sent, self.comm.wait([work]))
        return buffer

    def share_ahead(self, sample: torch.Tensor, source: int) -> None:
        """Start broadcasting rank ``source``'s ``sample`` for the next call to read (:meth:`take_ahead`)."""
        self.ahead = self._broadcast(sample, source)

    def take_ahead(self) -> torch.Tensor | None:
        if self.ahead is None:
            return None
        (work, buffer, sent), self.ahead = self.ahead, None
        self.comm.record(OUTPUT, sent, self.comm.wait([work]))
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
        buffer = sample.contiguous() if self.comm.rank == source else _contiguous_like(sample)
        work, sent = self.comm.broadcast(buffer, source)
        return work, buffer, sent

    def _tag(self, unit: int, leaf: int) -> int:
        return self.tags[unit * TENSORS_PER_UNIT + leaf]


def _contiguous_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty buffer shaped as ``tensor`` to receive into: senders send their tensors' values in contiguous order.

    ``torch.empty_like`` would keep the strides of a permuted output (a video U-Net's or Sana's prediction is
    a permuted view), and the received contiguous bytes would land in the wrong places.
    """
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)
