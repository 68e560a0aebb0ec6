"""Row-banded 2-D convolution that pads its band with the neighbouring bands' boundary rows."""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook
from torch import nn

from ..errors import ParadiffError
from ..runtime.comm import Communicator, NeighbourExchange


def needs_halo(conv: nn.Conv2d) -> bool:
    """Whether a convolution reads rows outside its own output rows (kernel taller than one row).

    A patchifying convolution (stride = kernel height, no vertical padding) reads only the rows of its
    own outputs, provided bands start at a multiple of its stride (the family's row alignment).
    """
    patchify = conv.stride[0] == conv.kernel_size[0] and not isinstance(conv.padding, str) and conv.padding[0] == 0
    return conv.kernel_size[0] > 1 and not (patchify and conv.dilation[0] == 1)


def check_halo_conv(name: str, conv: nn.Conv2d) -> None:
    """Fail early for convolutions whose banded form would not equal the full one."""
    pad_h = conv.padding[0] if not isinstance(conv.padding, str) else None
    reach = (conv.kernel_size[0] - 1) * conv.dilation[0]
    if conv.padding_mode != "zeros" or pad_h is None or reach != 2 * pad_h:
        raise ParadiffError(
            f"Conv2d '{name}' (kernel {conv.kernel_size}, padding {conv.padding}, mode {conv.padding_mode}) "
            "cannot be split into row bands; supported: zero padding of (kernel - 1) * dilation / 2 rows"
        )


class HaloConv2dHook(ModelHook):
    """Replaces the forward of one ``nn.Conv2d`` that sees a row band of the image.

    The band is extended by ``padding`` rows from each neighbour (zeros at the image border, as the
    stock layer pads), then convolved by the layer's own forward with its vertical padding set to none
    for the call: the same sums the full convolution computes for these rows, with whatever weights the
    layer computes with (diffusers' layerwise casting, quantized layers). Warm-up steps use this step's
    rows; displaced steps last step's.
    """

    def __init__(self, comm: Communicator, name: str, tag: int):
        super().__init__()
        self.comm, self.name, self.tag = comm, name, tag

    def new_forward(self, module: nn.Conv2d, hidden_states: torch.Tensor) -> torch.Tensor:
        state = self.comm.state
        if state.partition is None:  # this call runs whole on every rank
            return self.fn_ref.original_forward(hidden_states)
        pad_h = module.padding[0]
        exchange = state.exchange(self.name, lambda: NeighbourExchange(self.comm, self.name, self.tag))
        top, bottom = hidden_states[:, :, :pad_h], hidden_states[:, :, -pad_h:]
        above, below = exchange.exchange(top, bottom, state.synchronous)
        border = torch.zeros_like(top)
        padded = torch.cat([border if above is None else above, hidden_states, border if below is None else below], 2)
        padding, module.padding = module.padding, (0, module.padding[1])
        try:  # the layer's own forward and the hooks beneath this one: cast or quantized weights stay theirs
            return self.fn_ref.original_forward(padded)
        finally:
            module.padding = padding
