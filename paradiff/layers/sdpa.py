"""One attention layer's ``scaled_dot_product_attention`` calls, caught whatever processor makes them.

A DiT's attention processor projects Q/K/V, normalises them per head, applies its rotary embedding
and calls PyTorch's ``scaled_dot_product_attention``, directly or through diffusers' dispatcher (the
``native`` backend). :class:`SDPAHook` runs the layer's forward inside a ``TorchFunctionMode`` that
hands each such call, as ``(batch, heads, tokens, head_dim)`` tensors, to the hook's :meth:`attend`;
everything else the processor does runs as it is. The mode is per call of one layer of one model:
no class or function is patched. Inside ``attend`` the mode is off, so the hook calls attention freely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from torch.overrides import TorchFunctionMode

from ..errors import ParadiffError

#: ``scaled_dot_product_attention``'s arguments, in order.
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class _CatchAttention(TorchFunctionMode):
    def __init__(self, hook: SDPAHook):
        super().__init__()
        self.hook, self.calls = hook, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        kwargs = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
        query, key, value = (kwargs.pop(name) for name in _SDPA_ARGS[:3])
        self.calls += 1
        return self.hook.attend(self.calls - 1, query, key, value, kwargs)


class SDPAHook(ModelHook):
    """On one attention layer (``name``): each ``scaled_dot_product_attention`` call of its forward goes to
    :meth:`attend`. A forward that makes none (another processor or attention backend) is refused: its
    attention would silently see this rank's tokens only."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def new_forward(self, module, *args, **kwargs):
        caught = _CatchAttention(self)
        with caught:
            output = self.fn_ref.original_forward(*args, **kwargs)
        if caught.calls == 0:
            raise ParadiffError(
                f"attention '{self.name}' ran without PyTorch's scaled_dot_product_attention (its processor is "
                f"{type(getattr(module, 'processor', None)).__name__}), which paradiff needs to see every rank's "
                "tokens; use diffusers' default processor and the 'native' attention backend"
            )
        return output

    def attend(self, call: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: dict):
        """The attention of the forward's ``call``-th attention (``options``: the other arguments, by name)."""
        raise NotImplementedError
