"""The rank layout of a CFG split composed with a strategy: a 2 × D mesh, cfg-major.

Rank ``r`` holds batch half ``g = r // D`` and strategy position ``d = r % D`` (``r = g·D + d``):

    cfg group (half) 0:  ranks 0 .. D-1      strategy groups: contiguous ranks
    cfg group (half) 1:  ranks D .. 2D-1     cfg pairs: (d, D + d)

The strategy exchanges data at every layer, the cfg split once per denoiser call; ``torchrun`` puts
contiguous ranks on one node, so this layout keeps the heavy traffic on a node's fast links and lets
only the cfg gather cross nodes. The groups are made with ``dist.new_group`` rather than a
``DeviceMesh``, because each must carry paradiff's timeout and come with a background twin
(:class:`RankGroup`). Where a library wants a ``DeviceMesh`` (diffusers' context parallelism),
:func:`context_parallel_mesh` wraps these same groups in one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .distributed import RankGroup, destroy_groups


@dataclass(frozen=True)
class MeshGroups:
    """This rank's groups in the mesh."""

    #: Every rank: agreeing on the noise, the banded VAE decode.
    world: RankGroup
    #: The two ranks (one per batch half) at this rank's strategy position; None without a cfg split.
    cfg: RankGroup | None
    #: The D ranks of this rank's batch half that run the strategy; None when D = 1 (the cfg split alone).
    strategy: RankGroup | None
    #: Groups made over these ones since (:meth:`adopt`), shut down with them.
    adopted: list = field(default_factory=list)

    def process_groups(self) -> list[dist.ProcessGroup]:
        ranks = [groups for groups in (self.world, self.cfg, self.strategy) if groups is not None]
        return [group for groups in ranks for group in groups.process_groups()] + self.adopted

    def reopen_tags(self) -> None:
        """Before installing a strategy again: each group's lasting tags may be reserved anew (``reopen``)."""
        for groups in {id(g): g for g in (self.world, self.cfg, self.strategy) if g is not None}.values():
            groups.tags.reopen()

    def adopt(self, meshes: list[DeviceMesh]) -> None:
        """Shut down with these groups those of ``meshes`` that are not already theirs: a context-parallel mesh
        (:func:`context_parallel_mesh`) and the meshes diffusers derives from it, such as its flattened one."""
        own = {id(group) for group in self.process_groups()}
        made = {id(group): group for mesh in meshes for group in (mesh.get_group(d) for d in range(mesh.ndim))}
        self.adopted.extend(group for key, group in made.items() if key not in own)

    def destroy(self) -> None:
        """Shut down every group of the mesh on this rank (call on every rank, once nothing runs over them)."""
        destroy_groups(*self.process_groups())


def build_mesh(cfg: int, degree: int, world: RankGroup) -> MeshGroups:
    """The groups of a ``cfg`` × ``degree`` mesh (``cfg`` is 1 or 2) over ``world``; called on every rank alike."""
    timeout = world.timeout
    if cfg == 1:
        return MeshGroups(world=world, cfg=None, strategy=world)
    if degree == 1:
        return MeshGroups(world=world, cfg=world, strategy=None)
    pairs = RankGroup.partition([[d, degree + d] for d in range(degree)], timeout)
    halves = RankGroup.partition([list(range(g * degree, (g + 1) * degree)) for g in range(cfg)], timeout)
    return MeshGroups(world=world, cfg=pairs, strategy=halves)


def context_parallel_mesh(groups: MeshGroups, sequence_dim: str, device_type: str) -> DeviceMesh:
    """A ``DeviceMesh`` over ``groups`` with the dimensions diffusers' context parallelism wants ("ring", "ulysses").

    ``sequence_dim`` ("ring" or "ulysses") spans the strategy's D ranks; the other one has size 1. With
    a CFG split a leading "cfg" dimension holds the two halves (cfg-major, as above), so diffusers
    runs within each half. Built with ``DeviceMesh.from_group``, the mesh reuses paradiff's groups
    (and their timeout) for every dimension, with any ``device_type`` ("cpu" included), instead of
    creating groups for an accelerator as ``init_device_mesh`` would. Called on every rank alike.
    """
    me = dist.get_rank()
    alone = dist.new_group([me], timeout=groups.strategy.timeout, use_local_synchronization=True)
    degree = groups.strategy.size
    shape = (1, degree) if sequence_dim == "ulysses" else (degree, 1)
    dims = [alone, groups.strategy.group] if sequence_dim == "ulysses" else [groups.strategy.group, alone]
    names = ("ring", "ulysses")
    if groups.cfg is not None:
        shape, dims, names = (2, *shape), [groups.cfg.group, *dims], ("cfg", *names)
    ranks = torch.arange(groups.world.size).view(shape)
    return DeviceMesh.from_group(dims, device_type, mesh=ranks, mesh_dim_names=names)
