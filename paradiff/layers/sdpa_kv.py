"""Keys and values completed where attention is computed, whatever processor the layer runs.

A DiT's attention processor projects Q/K/V, normalises them per head, applies its rotary
embedding (in 1, 2 or 3 dimensions), and calls PyTorch's ``scaled_dot_product_attention``, directly
or through diffusers' dispatcher (the ``native`` backend). :class:`SDPACompletionHook` puts a
``TorchFunctionMode`` around one attention layer's forward that catches that call and completes its
keys and values to every rank's tokens (this step's during warm-up, last step's afterwards). The
processor's own maths is untouched, so every family whose tokens are split by a plan runs the same
code, and each rank's tokens keep the rotary positions the plan gave them.

Full attention (no mask) does not depend on the order of the keys, so the pieces are concatenated
in rank order whatever the tokens are: image rows, frames, or prompt tokens split along with them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from torch.overrides import TorchFunctionMode

from ..errors import ParadiffError

#: ``scaled_dot_product_attention``'s arguments, in order.
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class JointText:
    """Prompt tokens that join the image tokens in self-attention, whole on every rank (not split).

    The family says whether they come before or after the image tokens; the plan's split of the image
    tokens records how many image tokens this rank holds (``image_tokens``), so whatever else an
    attention call carries (the prompt, registers, a per-sample number of valid prompt tokens) is the
    prompt part. Only the image part of the keys and values is completed.
    """

    def __init__(self, first: bool | None = None):
        #: Prompt before the image tokens (True), after them (False); None: no prompt joins them.
        self.first = first
        #: This rank's image tokens in the current call (set where the plan splits ``hidden_states``).
        self.image_tokens: int | None = None

    def image_count(self) -> int:
        return self.image_tokens

    def split(self, tensor: torch.Tensor, dim: int = -2) -> tuple[torch.Tensor, torch.Tensor]:
        """``(text, image)`` parts of ``tensor`` along its token dimension ``dim``."""
        image = self.image_count()
        text = tensor.shape[dim] - image
        if self.first:
            text_part, image_part = tensor.split([text, image], dim=dim)
        else:
            image_part, text_part = tensor.split([image, text], dim=dim)
        return text_part, image_part

    def join(self, text_part: torch.Tensor, image_part: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return torch.cat([text_part, image_part] if self.first else [image_part, text_part], dim=dim)


class _CompleteKeysAndValues(TorchFunctionMode):
    """Catches ``scaled_dot_product_attention`` and hands it completed keys and values."""

    def __init__(self, hook: SDPACompletionHook):
        super().__init__()
        self.hook, self.calls = hook, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        hook = self.hook
        kwargs = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
        query, key, value = (kwargs.pop(name) for name in _SDPA_ARGS[:3])
        if kwargs.get("is_causal"):
            raise ParadiffError(f"attention '{hook.name}' is causal, which the {hook.strategy} strategy cannot split")
        key_part, value_part = hook.completers(self.calls)
        self.calls += 1
        local_keys = key.shape[-2]
        text = hook.text
        if text.first is not None:
            key_text, key_image = text.split(key)
            value_text, value_image = text.split(value)
            key = text.join(key_text, key_part.complete(key_image, token_dim=-2))
            value = text.join(value_text, value_part.complete(value_image, token_dim=-2))
        else:
            key, value = key_part.complete(key, token_dim=-2), value_part.complete(value, token_dim=-2)
        if kwargs.get("attn_mask") is not None:
            kwargs["attn_mask"] = hook.complete_mask(kwargs["attn_mask"], local_keys, key.shape[-2])
        return func(query, key, value, **kwargs)


class SDPACompletionHook(ModelHook):
    """On one attention layer: its ``scaled_dot_product_attention`` calls attend to every rank's tokens.

    ``make_pair(name)`` makes the key and value completers of the layer's ``n``-th attention call
    (``name`` ends in ``.n``), once, when that call first happens.
    """

    def __init__(self, name: str, strategy: str, make_pair: Callable[[str], tuple], text: JointText):
        super().__init__()
        self.name, self.strategy, self.make_pair, self.text = name, strategy, make_pair, text
        self.pairs: list[tuple] = []

    def complete_mask(self, mask: torch.Tensor, local_keys: int, keys: int) -> torch.Tensor | None:
        """The mask over the completed keys: the prompt's part as given, the image's extended to every image token.

        A mask the model built over the whole sequence already fits. The image part is extended by its
        first column, so each query row must treat all of this rank's image keys alike (a padded prompt
        query may hide them all, as Chroma's mask does); refused otherwise: the other ranks' image keys
        would need a mask this rank does not have.
        """
        if mask.shape[-1] == keys != local_keys:
            return mask
        text_part, image_part = (None, mask) if self.text.first is None else self.text.split(mask, dim=-1)
        column = image_part[..., :1]
        if not bool((image_part == column).all()):
            raise ParadiffError(
                f"attention '{self.name}' masks some image tokens and not others, and the {self.strategy} strategy "
                "completes the keys of image tokens every query treats alike; use strategy='parastep' or 'cfg'"
            )
        attends = column.all() if mask.dtype == torch.bool else (column == 0).all()
        if text_part is None and bool(attends):
            return None  # masks nothing: the completed keys need no mask either
        prompt = 0 if text_part is None else text_part.shape[-1]
        image = column.expand(*mask.shape[:-1], keys - prompt)
        return image if text_part is None else self.text.join(text_part, image, dim=-1)

    def completers(self, call: int) -> tuple:
        while len(self.pairs) <= call:
            self.pairs.append(self.make_pair(f"{self.name}.{len(self.pairs)}"))
        return self.pairs[call]

    def new_forward(self, module, *args, **kwargs):
        with _CompleteKeysAndValues(self):
            return self.fn_ref.original_forward(*args, **kwargs)
