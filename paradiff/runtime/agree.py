"""Make every rank start from the same noise: the first pitfall of every earlier system.

Ranks that draw different starting latents (no generator passed, or different seeds per rank)
compute bands of different images and produce a garbled one. Before each call the ranks agree on a
seed when none is given, copy rank 0's generator states when generators are given, and copy rank 0's
``latents`` when latents are given. They also take rank 0's state of torch's global random generators: some
pipelines draw from them whatever generator they are given (SD3's ControlNet pipeline samples the control
image's latents with ``latent_dist.sample()``), which would give each rank another conditioning.
"""

from __future__ import annotations

import torch

from .comm import Communicator


def broadcast_from_first(tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (a new tensor; the argument is left untouched)."""
    buffer = tensor.detach().to(comm.device, copy=True).contiguous()
    comm.wait([comm.broadcast(buffer, 0)[0]])
    return buffer.to(tensor.device)


def agreed_seed(comm: Communicator) -> int:
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    return int(broadcast_from_first(seed, comm))


def agree_on_noise(kwargs: dict, comm: Communicator) -> dict:
    """``kwargs`` of a pipeline call with generator and latents made identical on every rank of ``comm``."""
    kwargs = dict(kwargs)
    generator = kwargs.get("generator")
    if generator is None:
        kwargs["generator"] = torch.Generator("cpu").manual_seed(agreed_seed(comm))
    else:
        for gen in generator if isinstance(generator, (list, tuple)) else [generator]:
            gen.set_state(broadcast_from_first(gen.get_state(), comm))
    if isinstance(kwargs.get("latents"), torch.Tensor):
        kwargs["latents"] = broadcast_from_first(kwargs["latents"], comm)
    torch.set_rng_state(broadcast_from_first(torch.get_rng_state(), comm))  # draws without a generator (below)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(broadcast_from_first(torch.cuda.get_rng_state(), comm))
    return kwargs
