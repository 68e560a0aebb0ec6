"""Self-attention over the whole image when each rank computes the queries of one band.

A band's queries need keys and values of every token. :class:`DisplacedKV` completes the band's own
K (or V) to the full sequence: this step's for every band during warm-up, last step's for the other
bands afterwards. For processors that compute K/V with ``attn.to_k`` / ``attn.to_v`` on the image
tokens and apply positions before projection (U-Nets, PixArt, SD3), a hook on those two projections
is enough and the stock processor's maths is untouched. Rotary models complete K/V inside their
family's processor, after the rotation.

With ``partial_context`` set (PCPP), displaced steps attend to the own band plus the rows nearest the
border of each neighbouring band (a fraction of that band's rows), received from the two neighbours
only; 0 means the own band alone.

With ``stale_dtype`` set, displaced steps send and keep the other bands' K/V in that narrower dtype and widen
them as they are read: the buffers that hold a whole sequence per attention layer shrink by the ratio of the
item sizes, and warm-up steps, which exchange this step's K/V, stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from diffusers.hooks import ModelHook
from torch import nn

from ..errors import ParadiffError
from ..models.base import DenoiserFamily
from ..runtime.comm import Communicator, NeighbourExchange, SlotExchange


class DisplacedKV:
    """Completes one layer's band of keys or values to the tokens the band attends to."""

    def __init__(
        self,
        comm: Communicator,
        name: str,
        tag: int | None,
        partial_context: float | None,
        stale_dtype: torch.dtype | None = None,
    ):
        self.comm, self.name, self.tag, self.partial_context = comm, name, tag, partial_context
        self.stale_dtype = stale_dtype

    def complete(self, local: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        comm, state = self.comm, self.comm.state
        gather = state.exchange(self.name, lambda: SlotExchange(comm, self.name))
        if state.synchronous or self.partial_context is None:
            slots = gather.gather(self._sent(local, state.synchronous), state.synchronous)
            return torch.cat(
                [local if r == comm.rank else s.to(local.dtype) for r, s in enumerate(slots)], dim=token_dim
            )
        if self.partial_context == 0:
            return local
        band_tokens = local.shape[token_dim]
        cols = state.partition.cols_for_band_tokens(band_tokens)
        band_rows = band_tokens // cols
        context = min(band_rows, max(1, math.ceil(self.partial_context * band_rows))) * cols
        top, bottom = local.narrow(token_dim, 0, context), local.narrow(token_dim, band_tokens - context, context)

        def from_last_full_gather():
            slots, rank = gather.latest, comm.rank
            above = slots[rank - 1].narrow(token_dim, band_tokens - context, context) if rank > 0 else None
            below = slots[rank + 1].narrow(token_dim, 0, context) if rank < comm.size - 1 else None
            return above, below

        key = self.name + ".context"
        neighbours = state.exchange(key, lambda: NeighbourExchange(comm, key, self.tag))
        above, below = neighbours.exchange(top, bottom, False, initial=from_last_full_gather)
        return torch.cat([t for t in (above, local, below) if t is not None], dim=token_dim)

    def _sent(self, local: torch.Tensor, synchronous: bool) -> torch.Tensor:
        """What this rank's piece travels and is kept as: narrowed on displaced steps where ``stale_dtype`` is
        narrower than the piece."""
        narrow = self.stale_dtype is not None and self.stale_dtype.itemsize < local.dtype.itemsize
        return local.to(self.stale_dtype) if narrow and not synchronous else local


class KVProjectionHook(ModelHook):
    """``post_forward`` of ``attn.to_k`` or ``attn.to_v``: a band's projection becomes the full one."""

    def __init__(self, kv: DisplacedKV):
        super().__init__()
        self.kv = kv

    def post_forward(self, module, output: torch.Tensor) -> torch.Tensor:
        if self.kv.comm.state.partition is None:  # this call runs whole on every rank
            return output
        return self.kv.complete(output, token_dim=1)


def plan_kv_completion(
    family: DenoiserFamily, layers: list[tuple[str, nn.Module]], kv_pair: Callable[[str], tuple], strategy: str
) -> tuple[list[tuple[nn.Module, ModelHook]], list[tuple[nn.Module, object]]]:
    """How each attention layer completes its K/V: ``(hooks on to_k/to_v, processors to install)``.

    ``kv_pair(name)`` makes the layer's key and value completers (objects with ``comm`` and
    ``complete(local, token_dim)``). Rotary families complete K/V in their own processor; the others
    through hooks on the two projections, which fused projections do not have.
    """
    hooks, processors = [], []
    for name, attn in layers:
        processor = family.displaced_processor(attn, lambda name=name: kv_pair(name))
        if processor is not None:
            processors.append((attn, processor))
            continue
        if getattr(attn, "fused_projections", False):
            raise ParadiffError(
                f"attention '{name}' uses fused QKV projections, which the {strategy} strategy cannot split; "
                "call unfuse_qkv_projections() on the pipeline first"
            )
        key, value = kv_pair(name)
        hooks += [(attn.to_k, KVProjectionHook(key)), (attn.to_v, KVProjectionHook(value))]
    return hooks, processors
