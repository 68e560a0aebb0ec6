"""Ulysses over a head count the ranks do not divide: zero heads pad it, and are dropped after attention.

Ulysses swaps tokens for heads, so each of D ranks attends over the whole sequence with H/D of the heads.
Where D does not divide H, zero heads fill the count up to the next multiple of D: a zero query attends
evenly to zero values, so a padded head's output is zero, and it is dropped once the exchange back has
run; the real heads are those of one device, bit for bit. diffusers 0.42's ``ulysses_anything`` pads the
same way inside its dispatcher; paradiff pads itself where it makes the attention call
(:class:`~paradiff.layers.sdpa_dispatch.DispatchedSDPAHook`), on every diffusers version.
"""

from __future__ import annotations

import torch


def padded_heads(heads: int, ranks: int) -> int:
    """The head count Ulysses runs over ``ranks`` ranks: ``heads`` up to the next multiple of ``ranks``."""
    return -(-heads // ranks) * ranks


def pad_heads(tensor: torch.Tensor, dim: int, ranks: int) -> torch.Tensor:
    """``tensor`` with zero heads (a mask: heads that mask nothing) added along ``dim`` up to a multiple of
    ``ranks``."""
    heads = tensor.shape[dim]
    missing = padded_heads(heads, ranks) - heads
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    fill = True if tensor.dtype == torch.bool else 0
    return torch.cat([tensor, tensor.new_full(shape, fill)], dim)
