"""A VAE decoder no family can band runs on one rank; the others receive what it decodes.

Video VAEs (Wan, CogVideoX, HunyuanVideo, LTX, Mochi, ...) carry state from one chunk of frames to
the next (causal 3D convolutions with a feature cache) and some attend over the whole clip, so neither
row bands nor frame pieces of their decode are exact without a family module per VAE. Decoding whole
on every rank gives every rank the decode's memory peak for the same latency as one rank; instead rank
0 decodes and broadcasts each decoder call's output, so the other ranks skip the decode's activations
(and its time on a shared machine). A decoder called several times per decode (a chunk of frames, a
tile) is broadcast call by call. Only the decoded tensor travels: a decoder that also returns its
cache for the next call (CogVideoX) hands the other ranks ``None`` for it, since only the decoder,
which they never run, reads it.
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from ..errors import ParadiffError
from ..runtime.comm import OUTPUT, Communicator

#: dtypes a decoded tensor may have, by their index in the header.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Header entries: output kind (0: a tensor; n: a tuple of n with the tensor first), dtype, ndim, shape.
_HEADER = 3 + 8


class DecodeOnOneRankHook(ModelHook):
    """On a VAE decoder: rank 0 runs it; every rank returns rank 0's output."""

    def __init__(self, comm: Communicator):
        super().__init__()
        self.comm = comm

    def new_forward(self, module, *args, **kwargs):
        comm = self.comm
        header = torch.zeros(_HEADER, dtype=torch.int64, device=comm.device)
        if comm.rank == 0:
            output = self.fn_ref.original_forward(*args, **kwargs)
            decoded = output[0] if isinstance(output, tuple) else output
            if decoded.dtype not in _DTYPES or decoded.dim() > _HEADER - 3:
                raise ParadiffError(f"a decoder output of {decoded.dtype} with {decoded.dim()} dims cannot be shared")
            kind = len(output) if isinstance(output, tuple) else 0
            header[:3] = torch.tensor([kind, _DTYPES.index(decoded.dtype), decoded.dim()])
            header[3 : 3 + decoded.dim()] = torch.tensor(decoded.shape)
        self._share(header)
        kind, dtype, ndim = (int(v) for v in header[:3])
        if comm.rank != 0:
            shape = tuple(int(v) for v in header[3 : 3 + ndim])
            decoded = torch.empty(shape, dtype=_DTYPES[dtype], device=comm.device)
            output = (decoded, *[None] * (kind - 1)) if kind else decoded
        self._share(decoded.contiguous() if comm.rank == 0 else decoded, kind=OUTPUT)
        return output

    def _share(self, tensor: torch.Tensor, kind: str | None = None) -> None:
        work, sent = self.comm.broadcast(tensor, 0)
        waited = self.comm.wait([work])
        if kind:
            self.comm.record(kind, sent, waited)
