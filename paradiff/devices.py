"""This rank's device and dtype, from the names generate, bench and plan take (``--device``, ``--dtype``)."""

from __future__ import annotations

import warnings

from .errors import ParadiffError, ParadiffWarning

#: ``--dtype`` names.
DTYPES = ("float32", "float16", "bfloat16")


def rank_device(requested: str):
    """This rank's ``torch.device`` for ``--device`` (``auto``: this rank's GPU when CUDA is present)."""
    import torch

    from .runtime.distributed import env_world_size, local_device

    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise ParadiffError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if requested == "cpu":
        if cuda and env_world_size() > 1:  # only under torchrun: paradiff's own workers then see no GPU
            raise ParadiffError(
                "--device cpu on ranks that see a GPU: paradiff's process group and strategies follow the GPUs "
                "torch sees; hide them (CUDA_VISIBLE_DEVICES=) to run on the CPU under torchrun"
            )
        return torch.device("cpu")
    return local_device()


def torch_dtype(requested: str, device):
    """The ``torch.dtype`` for ``--dtype`` on ``device`` (``auto``: float16 on CUDA, float32 elsewhere)."""
    import torch

    name = requested if requested != "auto" else ("float16" if device.type == "cuda" else "float32")
    if name == "float16" and device.type == "cpu":
        warnings.warn(
            "--dtype float16 on the CPU is slow in PyTorch (many kernels convert to float32 and back); "
            "bfloat16 or float32 run faster there",
            ParadiffWarning,
            stacklevel=2,
        )
    return getattr(torch, name)
