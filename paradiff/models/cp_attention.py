"""Attention processors that let diffusers' context parallelism (Ulysses, ring) run PixArt and SD3.

diffusers runs Ulysses or ring attention inside ``dispatch_attention_fn`` when the processor hands
it a ``parallel_config``, and ``enable_parallelism`` gives one to every processor that declares it
(``paradiff.compat.DispatchedAttentionProcessor``). The stock ``AttnProcessor2_0`` (PixArt) and
``JointAttnProcessor2_0`` (SD3) call ``F.scaled_dot_product_attention`` themselves and declare no
such attribute: under a sequence split they would silently attend to their own rank's tokens only.
These processors take the stock processors' steps (projections, per-head norms, output projection;
no ``attn.scale``, as the stock ones) and send the attention itself through diffusers' dispatcher,
in its ``(batch, tokens, heads, head_dim)`` layout.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import AttnProcessor2_0, JointAttnProcessor2_0
from torch import nn

from ..compat import DispatchedAttentionProcessor
from ..errors import ParadiffError


def _heads(attn: nn.Module, tokens: torch.Tensor, projections, norms) -> list[torch.Tensor]:
    """Q, K, V of ``tokens`` as ``(batch, tokens, heads, head_dim)``, with the layer's per-head norms."""
    out = [projection(tokens).unflatten(-1, (attn.heads, -1)) for projection in projections]
    for index, norm in enumerate(norms):
        if norm is not None:
            out[index] = norm(out[index])
    return out


class _DispatchedAttention(DispatchedAttentionProcessor):
    """The attention step of a stock processor, run by diffusers' dispatcher (which runs Ulysses or ring)."""

    #: The stock processor this one replaces.
    stock: type = object

    @classmethod
    def replacing(cls, name: str, attn: nn.Module):
        """The replacement for ``attn``'s processor, refusing any other processor or an unusual layer option."""
        processor = attn.processor
        if type(processor) is not cls.stock:
            raise ParadiffError(
                f"attention '{name}' uses {type(processor).__name__}, which sequence parallelism cannot run; "
                f"supported: {cls.stock.__name__} (call unfuse_qkv_projections() or set_default_attn_processor() "
                "on the model first)"
            )
        unusual = [
            option
            for option, present in (
                ("spatial_norm", getattr(attn, "spatial_norm", None) is not None),
                ("group_norm", getattr(attn, "group_norm", None) is not None),
                ("residual_connection", getattr(attn, "residual_connection", False)),
                ("rescale_output_factor", getattr(attn, "rescale_output_factor", 1.0) != 1.0),
            )
            if present
        ]
        if unusual:
            raise ParadiffError(
                f"attention '{name}' uses {', '.join(unusual)}, which sequence parallelism does not support"
            )
        return cls()


class ContextParallelAttnProcessor(_DispatchedAttention):
    """``AttnProcessor2_0`` for an image self-attention layer (PixArt's ``attn1``) without a mask."""

    stock = AttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ParadiffError(
                "sequence parallelism runs image self-attention without a mask; this call passed "
                f"{'an attention mask' if attention_mask is not None else 'encoder_hidden_states'} to it"
            )
        query, key, value = _heads(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
        return attn.to_out[1](attn.to_out[0](self.dispatch(query, key, value)))


class ContextParallelJointAttnProcessor(_DispatchedAttention):
    """``JointAttnProcessor2_0`` (SD3 joint attention, and SD3.5's image-only second attention).

    Image and text tokens are both split over the ranks; on each rank they are concatenated in the
    stock order (image first), and each token's output comes back to the rank that holds it, so the
    split at the local image length is the stock split.
    """

    stock = JointAttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        image_tokens = hidden_states.shape[1]
        query, key, value = _heads(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
        if encoder_hidden_states is not None:
            projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text = _heads(attn, encoder_hidden_states, projections, (attn.norm_added_q, attn.norm_added_k))
            query, key, value = (torch.cat(pair, dim=1) for pair in zip((query, key, value), text, strict=True))
        out = self.dispatch(query, key, value)
        image = attn.to_out[1](attn.to_out[0](out[:, :image_tokens]))
        if encoder_hidden_states is None:
            return image
        text_out = out[:, image_tokens:]
        return image, text_out if attn.context_pre_only else attn.to_add_out(text_out)
