"""Point-to-point transfers between the stages of a pipeline (``pipefusion``, ``dualparal``).

Stage ``s`` (rank ``s`` of the strategy's group) receives each patch's activations from stage ``s−1``
and sends its own to stage ``s+1``; a flowing ``pipefusion`` also sends the next call's latent at a
finished patch from the last stage to the first (:mod:`paradiff.stages.flow`). Every message has a tag
reserved from the communicator on every rank alike; receives are posted ahead of their use, so each
transfer lands while the stage computes, and sends are asynchronous, waited for when the stage's work
of the call is done. After the last stage the denoiser's output goes to every rank with one broadcast.

Every wait is bounded by the group's timeout and counted: as bytes and waits per step (kinds ``pipe``
and ``output``) and as the current call's idle time, the share of the pipeline's bubble this rank sees.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..runtime.comm import OUTPUT, PIPE, Communicator


class StageLink:
    """This stage's transfers; received messages are kept by key until taken, their buffers reused.

    Its transfers are started from inside the denoiser's forward with patch indices and counts: under
    ``torch.compile`` those would become symbolic integers, and a message tag must be a plain one, so they
    run outside any compiled graph (``torch.compiler.disable``).
    """

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.posted: dict[Hashable, tuple[torch.Tensor, object]] = {}
        self.free: list[torch.Tensor] = []
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.call_tags = range(0)
        #: Seconds this rank waited for another stage during the current call.
        self.idle_s = 0.0

    @property
    def first(self) -> bool:
        return self.comm.rank == 0

    @property
    def last(self) -> bool:
        return self.comm.rank == self.comm.size - 1

    def begin_call(self, patches: int = 0) -> None:
        """A call starts (on every stage alike): no idle time yet; ``patches`` fresh tags for :meth:`expect`."""
        self.idle_s = 0.0
        if patches:
            self.call_tags = self.comm.tags(patches)

    # Messages by key.

    @torch.compiler.disable
    def post(self, key: Hashable, source: int, tag: int, shape: tuple[int, ...], like: torch.Tensor) -> None:
        """Start receiving message ``tag`` from rank ``source`` (``like``'s dtype, device), kept as ``key``."""
        if key in self.posted:
            return
        match = next((i for i, b in enumerate(self.free) if b.shape == shape and b.dtype == like.dtype), None)
        buffer = self.free.pop(match) if match is not None else like.new_empty(shape)
        self.posted[key] = (buffer, self.comm.receive(buffer, source, tag))

    @torch.compiler.disable
    def take(self, key: Hashable) -> torch.Tensor:
        """The message kept as ``key``, waiting for it if it has not arrived yet; :meth:`release` it when read."""
        buffer, work = self.posted.pop(key)
        self._waited(PIPE, self.comm.wait([work]))
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from :meth:`take`) is read: a later message may land in it."""
        self.free.append(buffer)

    def discard(self) -> None:
        """Wait for every posted message and drop what it brought (the stage will not read it)."""
        for key in list(self.posted):
            self.release(self.take(key))

    @torch.compiler.disable
    def send_to(self, to: int, tag: int, tensor: torch.Tensor, step: int | None = None) -> None:
        """Start sending ``tensor`` (kept alive until sent) to rank ``to`` as message ``tag``."""
        tensor = tensor.contiguous()
        work, nbytes = self.comm.send(tensor, to, tag)
        self.sends.append((work, tensor))
        self.comm.record(PIPE, nbytes, step=step)

    # Messages by index within one call (``dualparal``).

    def expect(self, count: int, shape: tuple[int, ...], like: torch.Tensor) -> None:
        """Post the receives of the call's ``count`` messages of ``shape`` from the previous stage."""
        for index in range(count):
            self.post(index, self.comm.rank - 1, self.call_tags[index], shape, like)

    def receive(self, index: int) -> torch.Tensor:
        """Message ``index`` of the call from the previous stage (its buffer is reused after the call's next one)."""
        buffer = self.take(index)
        self.release(buffer)
        return buffer

    def send(self, index: int, tensor: torch.Tensor) -> None:
        """Start sending the call's message ``index`` to the next stage."""
        self.send_to(self.comm.rank + 1, self.call_tags[index], tensor)

    # The end of a call.

    def finish(self) -> None:
        """Wait until every message this stage sent has left."""
        self._waited(PIPE, self.drain_sends())

    def share_output(self, sample: torch.Tensor) -> None:
        """Overwrite ``sample`` in place with the last stage's (one broadcast; every rank then holds it)."""
        comm = self.comm
        work, sent = comm.broadcast(sample, comm.size - 1)
        wait_s = comm.wait([work])
        comm.record(OUTPUT, sent, wait_s)
        self.idle_s += wait_s

    def drain_sends(self) -> float:
        """Wait for the sends still in flight; returns the seconds blocked."""
        if not self.sends:
            return 0.0
        wait_s = self.comm.wait([work for work, _ in self.sends])
        self.sends = []
        return wait_s

    def drain(self) -> float:
        """Wait for every transfer still in flight (the end of a ``pipe(...)`` call); returns the seconds blocked."""
        wait_s = self.drain_sends()
        if self.posted:
            wait_s += self.comm.wait([work for _, work in self.posted.values()])
            self.free += [buffer for buffer, _ in self.posted.values()]
            self.posted = {}
        return wait_s

    def _waited(self, kind: str, wait_s: float) -> None:
        self.comm.record(kind, wait_s=wait_s, exchanges=0)
        self.idle_s += wait_s
