"""What a block of a DiT returns: its image tokens, or both token streams in the order its class returns them."""

from __future__ import annotations

import torch
from torch import nn

from ..compat import block_returns_image_first
from ..models.base import BlockStack


def block_output(stack: BlockStack, block: nn.Module, image: torch.Tensor, text: torch.Tensor | None):
    """What ``block`` returns: the image tokens, or both streams in the block's own order when text flows through."""
    if stack.text_arg is None:
        return image
    return (image, text) if block_returns_image_first(type(block)) else (text, image)


def block_streams(block: nn.Module, output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image, text)`` from the two token streams ``block`` returned, in whichever order it returns them."""
    first, second = output
    return (first, second) if block_returns_image_first(type(block)) else (second, first)
