"""Training runs made in the test process, computed as the training scripts compute them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from paradiff.builtin.train import THREADS


def as_the_script(train: Callable, *args, **kwargs) -> None:
    """``train(*args, **kwargs)`` at the scripts' default thread count, then the count as it was.

    The scripts' ``main`` sets it, and a process's first ``torch.set_num_threads`` call changes the bits its matrix
    products give even at the count torch started with: a run made before any call differs from one made through
    ``main`` (or after another test's fixture restored the count), and the tests compare the two bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        train(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def weights_in(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of the one safetensors file a written model folder holds."""
    return load_file(next(folder.glob("*.safetensors")))
