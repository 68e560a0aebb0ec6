"""Make every rank start from the same noise: the first pitfall of every earlier system.

Ranks that draw different starting latents (no generator passed, or different seeds per rank)
compute bands of different images and produce a garbled one. Before each call the ranks agree on a
seed when none is given, copy rank 0's generator states when generators are given, and copy rank 0's
``latents`` when latents are given.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ParadiffError
from .distributed import RankGroup


def _comm_device(ranks: RankGroup) -> torch.device:
    if dist.get_backend(ranks.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_first(tensor: torch.Tensor, ranks: RankGroup) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (a new tensor; the argument is left untouched)."""
    buffer = tensor.detach().to(_comm_device(ranks), copy=True).contiguous()
    dist.broadcast(buffer, src=ranks.global_rank(0), group=ranks.group)
    return buffer.to(tensor.device)


def agreed_seed(ranks: RankGroup) -> int:
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    return int(broadcast_from_first(seed, ranks))


def agree_on_noise(kwargs: dict, ranks: RankGroup) -> dict:
    """``kwargs`` of a pipeline call with generator and latents made identical on every rank."""
    kwargs = dict(kwargs)
    _check_same_noise_arguments(kwargs, ranks)
    generator = kwargs.get("generator")
    if generator is None:
        kwargs["generator"] = torch.Generator("cpu").manual_seed(agreed_seed(ranks))
    else:
        for gen in generator if isinstance(generator, (list, tuple)) else [generator]:
            gen.set_state(broadcast_from_first(gen.get_state(), ranks))
    if isinstance(kwargs.get("latents"), torch.Tensor):
        kwargs["latents"] = broadcast_from_first(kwargs["latents"], ranks)
    return kwargs


def _check_same_noise_arguments(kwargs: dict, ranks: RankGroup) -> None:
    """Every rank must pass (or omit) the same kinds of noise arguments, or the agreement would not match."""
    generator = kwargs.get("generator")
    count = len(generator) if isinstance(generator, (list, tuple)) else int(generator is not None)
    mine = torch.tensor([count, int(isinstance(kwargs.get("latents"), torch.Tensor))], dtype=torch.int64)
    device = _comm_device(ranks)
    everyone = [torch.empty_like(mine, device=device) for _ in range(ranks.size)]
    dist.all_gather(everyone, mine.to(device), group=ranks.group)
    if any(not torch.equal(other.cpu(), mine) for other in everyone):
        seen = [other.tolist() for other in everyone]
        raise ParadiffError(
            f"ranks disagree on the noise arguments ([generators, latents given] per rank: {seen}); "
            "pass the same generator and latents arguments on every rank, or none"
        )
