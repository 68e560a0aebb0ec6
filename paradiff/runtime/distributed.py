"""Joining (or creating) the torch.distributed world that paradiff runs on.

paradiff is called on every rank of a ``torchrun`` job. If the user has not created a process group
yet, one is created from the torchrun environment: gloo on CPU, NCCL on CUDA with the device picked by
``LOCAL_RANK``. paradiff then makes its own group over the same ranks so that every one of its
collectives carries paradiff's timeout, whatever timeout the user's default group has.

``PARADIFF_BACKEND=gloo`` keeps CUDA ranks on gloo: several ranks may then share one GPU (NCCL refuses
two ranks on one device), and a machine without NCCL still runs; paradiff stages the CUDA tensors it
sends through host memory (:class:`~paradiff.runtime.comm.HostStaging`).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ParadiffError


def env_world_size() -> int:
    """World size as torch.distributed or the torchrun environment sees it (1 outside a job)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device() -> torch.device:
    """The device this rank should compute on: ``cuda:LOCAL_RANK`` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKEND_VARIABLE = "PARADIFF_BACKEND"


def backend_for(device: torch.device) -> str:
    """The process group backend for ranks on ``device``: NCCL on CUDA, gloo on CPU, or as
    ``PARADIFF_BACKEND`` (``auto``, ``nccl``, ``gloo``) asks."""
    requested = os.environ.get(BACKEND_VARIABLE, "auto")
    if requested not in ("auto", "nccl", "gloo"):
        raise ParadiffError(f"{BACKEND_VARIABLE}={requested!r} is not a backend paradiff uses; use auto, nccl or gloo")
    if device.type != "cuda":
        if requested == "nccl":
            raise ParadiffError(f"{BACKEND_VARIABLE}=nccl needs CUDA ranks, and these run on {device.type}; unset it")
        return "gloo"
    return "gloo" if requested == "gloo" else "nccl"


def can_join_world() -> bool:
    """Whether a process group exists or the torchrun environment says how to create one."""
    return dist.is_initialized() or all(name in os.environ for name in TORCHRUN_VARIABLES)


def ensure_process_group(timeout: timedelta) -> None:
    """Create the default process group from the torchrun environment if none exists yet.

    A group made here is also destroyed here, at interpreter exit, as torch.distributed asks of whoever
    creates one (NCCL warns otherwise); a group the caller made stays the caller's.
    """
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"no torch.distributed process group exists and the torchrun variables {missing} are not set; "
            "launch with `torchrun --nproc-per-node N script.py` or call init_process_group first"
        )
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend_for(device) == "nccl":
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


#: gloo carries message tags as 32-bit signed integers.
TAG_LIMIT = 2**31 - 1


@dataclass
class TagCounter:
    """Hands out the message tags of one process group, in the same order on every rank.

    Lasting tags (a layer's own, reserved when a strategy is installed) are never handed out again.
    Tags for one call's messages are handed out in turn and come round again only after the whole range
    has been used once, so a receive that a failed call left posted matches no message for a long time.
    """

    next: int = 1
    #: Where call tags start again after the last one: past every lasting tag.
    calls_start: int = 1

    def reopen(self) -> None:
        """Let a strategy installed again (on a model changed since) reserve lasting tags: past every tag handed
        out so far, so none of them is handed out again before the range comes round."""
        self.calls_start = self.next

    def reserve(self, count: int, lasting: bool) -> range:
        if lasting:
            if self.next != self.calls_start:
                raise RuntimeError("lasting message tags are reserved at install time, before any call's tags")
            self.calls_start += count
        elif self.next + count > TAG_LIMIT:
            self.next = self.calls_start
        if self.next + count > TAG_LIMIT:
            raise RuntimeError(f"{count} message tags do not fit below {TAG_LIMIT} after the lasting ones")
        start, self.next = self.next, self.next + count
        return range(start, start + count)


@dataclass
class RankGroup:
    """The ranks one strategy runs over, this rank's place among them, and two process groups.

    ``group`` carries what a rank waits for now (warm-up exchanges, the output gather);
    ``background`` carries displaced transfers that are needed only next step, so a large one in
    flight never delays the foreground (separate queues on gloo, separate streams on NCCL).
    """

    group: dist.ProcessGroup
    background: dist.ProcessGroup
    rank: int
    size: int
    timeout: timedelta
    #: Message tags of these groups (``Communicator.tags`` reserves them): kept per group, because
    #: several communicators (the denoiser's, the VAE decoder's) may share one.
    tags: TagCounter = field(default_factory=lambda: TagCounter(), compare=False)

    @classmethod
    def world(cls, timeout: timedelta) -> RankGroup:
        """paradiff-owned groups over the whole world, carrying ``timeout`` on every collective."""
        ensure_process_group(timeout)
        return cls.partition([list(range(dist.get_world_size()))], timeout)

    @classmethod
    def partition(cls, rank_lists: list[list[int]], timeout: timedelta) -> RankGroup:
        """paradiff-owned groups over the one list of ``rank_lists`` (disjoint) that holds this rank.

        ``dist.new_group`` is a collective of the whole world: every rank creates every list's groups,
        in the same order, and keeps the ones it belongs to.
        """
        me, mine = dist.get_rank(), None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks, timeout=timeout)
            background = dist.new_group(ranks=ranks, timeout=timeout)
            if me in ranks:
                rank = dist.get_rank(group)
                mine = cls(group=group, background=background, rank=rank, size=len(ranks), timeout=timeout)
        if mine is None:
            raise RuntimeError(f"rank {me} is in none of the rank lists {rank_lists}")
        return mine

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def process_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        return self.group, self.background


def destroy_groups(*groups: dist.ProcessGroup) -> None:
    """Shut down paradiff's own process groups (each once; the default group is the user's and stays).

    Local to this rank. Gloo keeps threads and sockets per group until it is shut down, so a process
    that parallelizes many pipelines would otherwise accumulate them, and their polling, for good.
    """
    for group in {id(group): group for group in groups}.values():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
