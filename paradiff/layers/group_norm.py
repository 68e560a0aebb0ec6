"""GroupNorm over the whole image when each rank holds one row band of it."""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook
from torch import nn

from ..runtime.comm import Communicator, SlotExchange


class BandGroupNormHook(ModelHook):
    """Replaces the forward of one ``nn.GroupNorm`` that sees a row band of the image.

    Each rank computes its band's per-group mean and biased variance (in float32); the global
    statistics combine them exactly for equal bands: ``mean = avg(mean_r)``,
    ``var = avg(var_r) + avg((mean_r - mean)^2)`` — the biased variance ``nn.GroupNorm`` uses. On a
    displaced step the other bands' statistics are last step's and this band's are fresh (DistriFusion's
    corrected asynchronous GroupNorm). Combining (mean, variance) pairs rather than (E[x], E[x^2]) cannot
    produce a negative variance, so no fallback to the local variance is needed.
    """

    def __init__(self, comm: Communicator, name: str):
        super().__init__()
        self.comm, self.name = comm, name

    def new_forward(self, module: nn.GroupNorm, hidden_states: torch.Tensor) -> torch.Tensor:
        comm, state = self.comm, self.comm.state
        if state.partition is None:  # this call runs whole on every rank
            return self.fn_ref.original_forward(hidden_states)
        batch = hidden_states.shape[0]
        mean, var = _band_statistics(hidden_states, module)
        local = torch.stack([mean, var], dim=-1)
        slots = state.exchange(self.name, lambda: SlotExchange(comm, self.name)).gather(local, state.synchronous)
        stats = torch.stack([local if r == comm.rank else s for r, s in enumerate(slots)])
        mean = stats[..., 0].mean(0)
        var = stats[..., 1].mean(0) + (stats[..., 0] - mean).square().mean(0)
        # normalization and affine in one fused pass: x * scale + shift, per (sample, channel)
        per_group = hidden_states.shape[1] // module.num_groups
        scale = torch.rsqrt(var + module.eps).repeat_interleave(per_group, dim=1)
        shift = -mean.repeat_interleave(per_group, dim=1) * scale
        if module.affine:
            scale, shift = scale * module.weight, shift * module.weight + module.bias
        shape = (batch, -1) + (1,) * (hidden_states.ndim - 2)
        dtype = hidden_states.dtype
        return torch.addcmul(shift.to(dtype).view(shape), hidden_states, scale.to(dtype).view(shape))


def _band_statistics(hidden_states: torch.Tensor, module: nn.GroupNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(sample, group) mean and biased variance of this band, in float32, as ``nn.GroupNorm`` computes them.

    The stock kernel returns the mean and ``1 / sqrt(var + eps)`` in one fused pass, several times
    faster on CPU than ``torch.var_mean``; the variance is recovered from it. Its statistics carry no
    gradient, so when a gradient is wanted the slower differentiable ``var_mean`` is used instead.
    """
    batch, channels = hidden_states.shape[:2]
    if torch.is_grad_enabled() and hidden_states.requires_grad:
        var, mean = torch.var_mean(hidden_states.reshape(batch, module.num_groups, -1).float(), dim=-1, correction=0)
        return mean, var
    spatial = hidden_states.numel() // (batch * channels)
    _, mean, rstd = torch.ops.aten.native_group_norm(
        hidden_states.contiguous(), None, None, batch, channels, spatial, module.num_groups, module.eps
    )
    mean, rstd = mean.float().reshape(batch, -1), rstd.float().reshape(batch, -1)
    return mean, rstd.pow(-2) - module.eps
