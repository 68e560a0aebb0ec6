"""Run a function on N local ranks: through torch's elastic launcher, or on the ranks torchrun made."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_on_ranks(fn: Callable, nproc: int, *args):
    """``fn(*args)`` on every rank; returns rank 0's result.

    Under ``torchrun`` (or any launcher that set ``RANK``/``WORLD_SIZE``) this process is already one
    rank and ``fn`` runs here. Otherwise ``nproc`` worker processes are started with
    :func:`torch.distributed.launcher.api.elastic_launch` on this machine.
    """
    if under_torchrun() or nproc == 1:
        return fn(*args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"paradiff-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)[0]
