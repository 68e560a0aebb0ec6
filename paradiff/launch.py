"""Run a function on N local ranks: through torch's elastic launcher, or on the ranks torchrun made."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ParadiffError


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def ranks_to_use(nproc: int) -> int:
    """The world size a job will have: torchrun's when under it, else ``nproc``."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc


@dataclass(frozen=True)
class _RankError:
    message: str


def _call_reporting_errors(fn: Callable, *args):
    """``fn(*args)`` on a worker rank, returning a :class:`ParadiffError` as a value the launcher hands back.

    Without this, a bad input found on the ranks (a size the strategy cannot split, say) would reach
    the user as the launcher's ``ChildFailedError`` with every rank's traceback.
    """
    try:
        return fn(*args)
    except ParadiffError as error:
        return _RankError(str(error))


def run_on_ranks(fn: Callable, nproc: int, *args):
    """``fn(*args)`` on every rank; returns rank 0's result.

    Under ``torchrun`` (or any launcher that set ``RANK``/``WORLD_SIZE``) this process is already one
    rank and ``fn`` runs here. Otherwise ``nproc`` worker processes are started with
    :func:`torch.distributed.launcher.api.elastic_launch` on this machine, and a
    :class:`ParadiffError` raised on them is raised again here.
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
    results = elastic_launch(config, _call_reporting_errors)(fn, *args)
    errors = [result.message for result in results.values() if isinstance(result, _RankError)]
    if errors:
        raise ParadiffError(errors[0])
    return results[0]
