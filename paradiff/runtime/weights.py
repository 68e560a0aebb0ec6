"""Checksums of a model's weights that read quantized weights too: what the ranks compare at parallelize and each call.

torchao's and quanto's quantized weights are tensor subclasses (``Int8Tensor``, ``QBytesTensor``) whose
operators cover inference only, so ``torch.sum`` on one fails; their ``__tensor_flatten__`` names the
plain tensors that hold their content (the integer data, the scales), and those are summed instead. One
float64 sum per tensor, computed where the tensor lies and read back at once per device, so a call pays one
pass over the weights and one synchronisation per device; :class:`SumCache` skips the tensors unchanged since.
"""

from __future__ import annotations

import torch
from torch import nn


def plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s content: itself, or the parts a tensor subclass flattens into."""
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return [tensor]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return [tensor.as_subclass(torch.Tensor)]
    names, _ = flatten()
    return [part for name in names for part in plain_parts(getattr(tensor, name))]


def tensor_sums(tensors: list[torch.Tensor]) -> list[float]:
    """One float64 sum per tensor (of all its plain parts); 0.0 for a tensor without data (on the meta device)."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for index, tensor in enumerate(tensors):
        for part in plain_parts(tensor.detach()):
            if part.device.type == "meta":
                continue
            part = torch.view_as_real(part) if part.is_complex() else part
            by_device.setdefault(part.device, []).append((index, part.sum(dtype=torch.float64)))
    sums = [0.0] * len(tensors)
    for parts in by_device.values():
        for (index, _), value in zip(parts, torch.stack([s for _, s in parts]).tolist(), strict=True):
            sums[index] += value
    return sums


class SumCache:
    """Each tensor's sum from :func:`tensor_sums`, recomputed only for a tensor written since (its parts' ``_version``
    counter or storage changed): a call then reads none of the weights it read before.

    Writes through ``.data`` bump no counter, as they escape autograd; adapters merged that way (peft) show as
    merged in the adapters' own description.
    """

    def __init__(self):
        self.known: dict[int, tuple[tuple, float]] = {}

    def sums(self, tensors: list[torch.Tensor]) -> list[float]:
        keys = [_key(tensor) for tensor in tensors]
        stale = [i for i, (tensor, key) in enumerate(zip(tensors, keys, strict=True)) if self._get(tensor, key) is None]
        for i, value in zip(stale, tensor_sums([tensors[i] for i in stale]), strict=True):
            self.known[id(tensors[i])] = (keys[i], value)
        return [self.known[id(tensor)][1] for tensor in tensors]

    def _get(self, tensor: torch.Tensor, key: tuple) -> float | None:
        known = self.known.get(id(tensor))
        return known[1] if known is not None and known[0] == key else None


def _key(tensor: torch.Tensor) -> tuple:
    parts = plain_parts(tensor)
    return tuple((id(part), part._version, part.data_ptr(), part.dtype, part.shape) for part in parts)


def combined(sums: list[float]) -> float:
    """One checksum of many tensors' sums, each weighted by a small factor that cycles with its position, so that
    weights swapped between tensors change it too."""
    return sum((1 + position % 7) * value for position, value in enumerate(sums))


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by name."""
    return dict([*module.named_parameters(), *module.named_buffers()])
