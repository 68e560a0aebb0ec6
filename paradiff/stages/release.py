"""A rank that runs one stage of the blocks frees the other stages' parameters, and gets them back afterwards.

``pipefusion`` and ``dualparal`` keep on each rank only its stage of the block stack (and the layers every
rank runs); :func:`release_other_stages` frees the rest, remembering their shapes, and
:func:`stage_groups` / :func:`params_of` give the order in which the ranks broadcast them back when the
strategy is removed.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from ..errors import ParadiffError


def stage_groups(blocks: list[nn.Module], cut: tuple[int, ...]) -> list[list[nn.Module]]:
    """The blocks of each stage, in order: ``cut`` holds how many blocks each stage has."""
    bounds = [0, *itertools.accumulate(cut)]
    return [blocks[start:stop] for start, stop in itertools.pairwise(bounds)]


def params_of(blocks: list[nn.Module]) -> list[nn.Parameter]:
    """The blocks' parameters, each once, in a fixed order."""
    seen, params = set(), []
    for block in blocks:
        for param in block.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def check_releasable(blocks: list[tuple[str, nn.Module]], strategy: str) -> None:
    """Refuse, before any collective, block weights that cannot be freed and broadcast back: tensor subclasses whose
    operators do not cover it (torchao's quantized weights; optimum-quanto's can)."""
    for block_name, block in blocks:
        for name, param in block.named_parameters():
            if type(param) in (torch.Tensor, nn.Parameter):
                continue
            try:
                param.data.new_empty((0,))
            except NotImplementedError:
                raise ParadiffError(
                    f"strategy='{strategy}' frees each rank's other stages' weights and broadcasts them back "
                    f"afterwards, which it cannot do with {type(param).__name__} weights ({block_name}.{name}); use "
                    "strategy='patch' or 'ulysses' for this model, or quantize it with optimum-quanto, whose weights "
                    "it can"
                ) from None


def release_other_stages(
    denoiser: nn.Module, blocks: list[nn.Module], cut: tuple[int, ...], stage: int
) -> dict[int, torch.Size]:
    """Free the parameters of the other stages' blocks (those no kept module shares); their shapes by ``id``."""
    others = [block for s, group in enumerate(stage_groups(blocks, cut)) if s != stage for block in group]
    elsewhere = {id(m) for block in others for m in block.modules()}
    kept = {id(p) for m in denoiser.modules() if id(m) not in elsewhere for p in m.parameters(recurse=False)}
    home = next(p.device for p in denoiser.parameters() if p.device.type != "meta")
    released = {}
    for param in params_of(others):
        if id(param) not in kept:
            shape, empty = param.shape, torch.empty(0, dtype=param.dtype, device=home)
            if param.device.type == "meta":  # loaded by stage; a meta parameter cannot take real data in place
                param = _replace_parameter(others, param, empty)
            else:
                param.data = empty
            released[id(param)] = shape
    return released


def _replace_parameter(blocks: list[nn.Module], param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """Put a new parameter holding ``data`` wherever ``blocks`` hold ``param``; the new parameter."""
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    for block in blocks:
        for module in block.modules():
            for name, value in module._parameters.items():
                if value is param:
                    module._parameters[name] = new
    return new
