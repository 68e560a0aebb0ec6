"""Point-to-point transfers between neighbouring stages of a pipeline (``pipefusion``).

Stage ``s`` (rank ``s`` of the strategy's group) receives each patch's activations from stage ``s−1``
and sends its own to stage ``s+1``. At the start of a denoiser call a stage posts the receives of
every patch at once, so each transfer lands while the stage computes earlier patches; its sends are
asynchronous too, and it waits for them only when its last patch is out. Each call reserves one tag
per patch from the communicator; both sides post in patch order, which is what NCCL (which ignores
tags) needs. After the last
stage the denoiser's output goes to every rank with one broadcast.

Every wait is bounded by the group's timeout and counted: as bytes and waits per step (kinds ``pipe``
and ``output``) and as the current call's idle time, the share of the pipeline's bubble this rank sees.
"""

from __future__ import annotations

import torch

from ..runtime.comm import OUTPUT, PIPE, Communicator


class StageLink:
    """This stage's transfers within one call context and call slot; its receive buffers are reused.

    Its transfers are started from inside the denoiser's forward with patch indices and counts: under
    ``torch.compile`` those would become symbolic integers, and a message tag must be a plain one, so they
    run outside any compiled graph (``torch.compiler.disable``).
    """

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.buffers: list[torch.Tensor] = []
        self.receives: list = []
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

    def begin_call(self, patches: int) -> None:
        """A call of ``patches`` messages starts (on every stage alike): fresh tags, no idle time yet."""
        self.idle_s = 0.0
        self.call_tags = self.comm.tags(patches)

    @torch.compiler.disable
    def expect(self, count: int, shape: tuple[int, ...], like: torch.Tensor) -> None:
        """Post the receives of ``count`` messages of ``shape`` from the previous stage (``like``'s dtype, device)."""
        if len(self.buffers) != count or tuple(self.buffers[0].shape) != shape or self.buffers[0].dtype != like.dtype:
            self.buffers = [like.new_empty(shape) for _ in range(count)]
        source, tags = self.comm.rank - 1, self.call_tags
        self.receives = [self.comm.receive(buffer, source, tags[m]) for m, buffer in enumerate(self.buffers)]

    @torch.compiler.disable
    def receive(self, index: int) -> torch.Tensor:
        """Message ``index`` from the previous stage, waiting for it if it has not arrived yet."""
        self._waited(PIPE, self.comm.wait([self.receives[index]]))
        return self.buffers[index]

    @torch.compiler.disable
    def send(self, index: int, tensor: torch.Tensor) -> None:
        """Start sending message ``index`` (``tensor``, kept alive until sent) to the next stage."""
        tensor = tensor.contiguous()
        work, nbytes = self.comm.send(tensor, self.comm.rank + 1, self.call_tags[index])
        self.sends.append((work, tensor))
        self.comm.record(PIPE, nbytes)

    def finish(self) -> None:
        """Wait until the next stage has every message of this call."""
        self._waited(PIPE, self.drain())

    def share_output(self, sample: torch.Tensor) -> None:
        """Overwrite ``sample`` in place with the last stage's (one broadcast; every rank then holds it)."""
        comm = self.comm
        work, sent = comm.broadcast(sample, comm.size - 1)
        wait_s = comm.wait([work])
        comm.record(OUTPUT, sent, wait_s)
        self.idle_s += wait_s

    def drain(self) -> float:
        """Wait for the sends still in flight; returns the seconds blocked."""
        if not self.sends:
            return 0.0
        wait_s = self.comm.wait([work for work, _ in self.sends])
        self.sends = []
        return wait_s

    def _waited(self, kind: str, wait_s: float) -> None:
        self.comm.record(kind, wait_s=wait_s, exchanges=0)
        self.idle_s += wait_s
