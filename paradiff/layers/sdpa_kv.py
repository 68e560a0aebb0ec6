"""Keys and values completed where attention is computed, whatever processor the layer runs.

:class:`SDPACompletionHook` catches one attention layer's ``scaled_dot_product_attention`` calls
(``paradiff.layers.sdpa``) and completes their keys and values to every rank's tokens (this step's
during warm-up, last step's afterwards), after whatever projections, norms and rotary embeddings the
processor applied. The processor's own maths is untouched, so every family whose tokens are split by
a plan runs the same code, and each rank's tokens keep the rotary positions the plan gave them.

Full attention (no mask) does not depend on the order of the keys, so the pieces are concatenated
in rank order whatever the tokens are: image rows, frames, or prompt tokens split along with them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import ParadiffError
from .sdpa import SDPAHook


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


class SDPACompletionHook(SDPAHook):
    """On one attention layer: its ``scaled_dot_product_attention`` calls attend to every rank's tokens.

    ``make_pair(name)`` makes the key and value completers of the layer's ``n``-th attention call
    (``name`` ends in ``.n``), once, when that call first happens.
    """

    def __init__(self, name: str, strategy: str, make_pair: Callable[[str], tuple], text: JointText):
        super().__init__(name)
        self.strategy, self.make_pair, self.text = strategy, make_pair, text
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

    def attend(self, call, query, key, value, options):
        if options.get("is_causal"):
            raise ParadiffError(f"attention '{self.name}' is causal, which the {self.strategy} strategy cannot split")
        key_part, value_part = self.completers(call)
        local_keys, text = key.shape[-2], self.text
        if text.first is not None:
            key_text, key_image = text.split(key)
            value_text, value_image = text.split(value)
            key = text.join(key_text, key_part.complete(key_image, token_dim=-2))
            value = text.join(value_text, value_part.complete(value_image, token_dim=-2))
        else:
            key, value = key_part.complete(key, token_dim=-2), value_part.complete(value, token_dim=-2)
        if options.get("attn_mask") is not None:
            options["attn_mask"] = self.complete_mask(options["attn_mask"], local_keys, key.shape[-2])
        return F.scaled_dot_product_attention(query, key, value, **options)
