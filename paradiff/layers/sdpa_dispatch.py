"""diffusers' sequence-parallel attention for processors that call PyTorch's attention themselves.

diffusers runs Ulysses or ring attention inside its dispatcher (``dispatch_attention_fn`` with a
``parallel_config``), which only processors written for it call. Many stock processors (CogVideoX,
Allegro, Latte, Hunyuan-DiT, CogView4, AuraFlow, ...) call ``scaled_dot_product_attention`` directly:
under a sequence split they would attend to their own rank's tokens only. :class:`DispatchedSDPAHook`
catches that call (``paradiff.layers.sdpa``) and hands it to diffusers' dispatcher with the model's
parallel config, in the dispatcher's ``(batch, tokens, heads, head_dim)`` layout: diffusers' own
Ulysses (or ring) then runs inside the stock processor, without a copy of it. Under Ulysses a head count
the ranks do not divide is padded (``paradiff.layers.heads``).
"""

from __future__ import annotations

from ..compat import dispatch_attention_fn
from ..errors import ParadiffError
from ..runtime.comm import SYNC, Communicator
from .heads import pad_heads
from .sdpa import SDPAHook
from .sequence_hooks import attention_traffic


class DispatchedSDPAHook(SDPAHook):
    """On one attention layer: its attention runs in diffusers' dispatcher under ``parallel_config``.

    Counts the bytes this rank sends per call, as :class:`~paradiff.layers.sequence_hooks.AttentionTrafficHook`.
    """

    def __init__(self, name: str, parallel_config, backend: str | None, comm: Communicator, sequence_dim: str):
        super().__init__(name)
        self.parallel_config, self.backend = parallel_config, backend
        self.comm, self.sequence_dim = comm, sequence_dim

    def new_forward(self, module, *args, **kwargs):
        self.comm.record(SYNC, attention_traffic(module, args, kwargs, self.comm.size, self.sequence_dim))
        return super().new_forward(module, *args, **kwargs)

    def attend(self, call, query, key, value, options):
        if options.get("dropout_p") or options.get("is_causal"):
            raise ParadiffError(
                f"attention '{self.name}' uses dropout or a causal mask, which sequence parallelism cannot split"
            )
        heads, mask, scale = query.shape[1], options.get("attn_mask"), options.get("scale")
        if self.sequence_dim == "ulysses":  # whole heads per rank, whatever their count
            query, key, value = (pad_heads(t, 1, self.comm.size) for t in (query, key, value))
            if mask is not None and mask.dim() == 4 and mask.shape[1] == heads > 1:  # a mask per head
                mask = pad_heads(mask, 1, self.comm.size)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        out = dispatch_attention_fn(
            query, key, value, attn_mask=mask, scale=scale, backend=self.backend, parallel_config=self.parallel_config
        )
        return out.transpose(1, 2)[:, :heads]
