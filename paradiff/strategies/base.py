"""The contract every strategy implements, and the options dataclass each one owns.

A strategy is one module: a :class:`Strategy` subclass, its :class:`StrategyOptions` subclass if it
has options, and one line in the registry (:mod:`paradiff.strategies`). ``parallelize`` drives it in
this order, on every rank alike:

1. ``degrees(world_size, config)`` and ``check_world(degree, config)`` (class methods): the mesh, and
   whether this world suits the strategy's options, before any collective;
2. ``check_model(denoiser, family, degree, config)`` (class method): whether the model suits it, before any
   collective (skipped when the strategy runs on one rank per CFG half: then only the CFG split runs), then
   ``check_machine(denoiser)``: whether this machine and the model's attention backend can run it (a plan
   for another machine checks the model alone);
3. ``Strategy(config.options, groups)`` and ``install(denoiser, family, comm, vae_scale_factor)``, which
   returns the :class:`~paradiff.strategies.installation.Installation` that undoes it;
4. per ``pipe(...)`` call, ``check_height(...)`` before the call and ``installation.steer(pipe)`` around it.

The planner (``paradiff plan``, ``strategy="auto"``) reads the rest from the class: ``step_cost`` (its cost
model, in :mod:`paradiff.strategies.costing`'s terms; a strategy without one is never planned, and a plan that
names it says so), ``predicted_exact``, ``plan_variants`` and ``plan_refusal``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import ParadiffError

if TYPE_CHECKING:
    from torch import nn

    from ..config import ParallelConfig
    from ..models import Capability, DenoiserFamily
    from ..runtime.comm import Communicator
    from ..runtime.mesh import MeshGroups
    from .costing import CostMachine, CostSetting, PassCost, StepCost
    from .installation import Installation


@dataclass(frozen=True)
class StrategyOptions:
    """Options only one strategy reads. Field names are ``parallelize()`` keywords, so they carry the
    strategy's name where a bare name could be ambiguous (``pipefusion_patches``); a subclass validates
    its fields in ``__post_init__`` and raises :class:`~paradiff.errors.ParadiffError`."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))


def is_count(value, least: int) -> bool:
    """Whether ``value`` is an integer of at least ``least`` (a bool is not: ``True`` would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_counts(value, least: int) -> bool:
    """Whether ``value`` is a tuple or list of integers of at least ``least``."""
    return isinstance(value, (tuple, list)) and all(is_count(n, least) for n in value)


class Strategy:
    """How a denoiser's work is split over the D ranks of a group (within each CFG half)."""

    #: The name ``parallelize(strategy=...)`` takes.
    name: ClassVar[str] = ""
    #: The options it reads.
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    #: Displaced after warm-up, so ``warmup_steps`` trades speed for fidelity; False: exact at every step.
    uses_warmup: ClassVar[bool] = True
    #: How the staleness guard (``fidelity_floor_db``) makes a displaced step run in sync: ``"per call"``, a hook
    #: asks it before each denoiser call and the strategy reads its step state's ``synchronous``; ``"itself"``, the
    #: strategy asks its step state's ``guard`` where it can (``parastep``: when a round would start); None: it
    #: cannot, and a floor is refused.
    refreshes: ClassVar[str | None] = None
    #: Needs no knowledge of the denoiser's layers, so it runs any denoiser (the CFG split needs none either).
    model_agnostic: ClassVar[bool] = False
    #: The family capabilities (:class:`~paradiff.models.Capability`) it can work with, any one of them; empty:
    #: any described family. :meth:`supports`, the support matrix and the refusals derive from it.
    needs: ClassVar[tuple[Capability, ...]] = ()
    #: What a refusal adds after what the strategy needs: where to find a model that has it.
    refusal_hint: ClassVar[str] = ""
    #: The CFG split alone (``cfg``): sets ``cfg_parallel`` and runs no strategy within the halves.
    cfg_split_alone: ClassVar[bool] = False
    #: How one denoiser call's work lies on the group's ranks, which the step caches a user applied read
    #: (``paradiff.caches``): "tokens" (each rank a part of every call's tokens), "batch" (each rank a part of its
    #: batch), "whole" (each rank runs whole calls), "blocks" (each rank some of the blocks), "pieces" (each rank
    #: some of the blocks, over pieces of a call that follow one another); None: undeclared, so caches are refused.
    call_split: ClassVar[str | None] = None
    #: How many ranks it runs on, as messages about supported combinations say it.
    world: ClassVar[str] = "world = its degree"
    #: Whether it can re-install on a model whose layers were replaced after ``parallelize`` (a LoRA loaded,
    #: QKV fused): False for a strategy whose ranks each keep only a stage of the model.
    follows_model_changes: ClassVar[bool] = True
    #: Option settings a plan predicts besides the defaults, each with the least ranks it needs and, optionally,
    #: whether the plan also predicts it under the CFG split: ``((("asyncdiff_stride", 2),), 3)``,
    #: ``((("pipefusion_sync", "sequence"),), 2, True)``.
    plan_variants: ClassVar[tuple] = ()

    def __init__(self, options: StrategyOptions | None = None, groups: MeshGroups | None = None):
        self.options = options if options is not None else self.Options()
        self.groups = groups

    @classmethod
    def degrees(cls, world_size: int, config: ParallelConfig) -> tuple[int, int]:
        """``(cfg groups, ranks per group)``: ``(1, world_size)``, or ``(2, world_size // 2)`` with ``cfg_parallel``."""
        if not config.cfg_parallel:
            degree = world_size
        elif world_size % 2:
            from . import supported_combinations

            even = " or ".join(str(n) for n in (world_size - 1, world_size + 1) if n >= 2)
            raise ParadiffError(
                f"cfg_parallel needs an even world size, got {world_size}: the two CFG halves run on two equal "
                f"groups of ranks; launch {even} ranks (supported: {supported_combinations()})"
            )
        else:
            degree = world_size // 2
        cls.check_world(degree, config)
        return (2 if config.cfg_parallel else 1), degree

    @classmethod
    def supports(cls, family: DenoiserFamily) -> bool:
        """Whether the strategy runs denoisers of ``family``: every denoiser if ``model_agnostic`` (including
        ``AnyDenoiserFamily``, the family of a class nobody described), else a described family that offers one of
        the capabilities it :attr:`needs`."""
        if cls.model_agnostic:
            return True
        return family.described and (not cls.needs or not family.capabilities.isdisjoint(cls.needs))

    @classmethod
    def refusal(cls, denoiser: nn.Module, family: DenoiserFamily) -> str:
        """Why it does not run ``denoiser``, what it needs, which classes it runs and which strategies run this one."""
        from .support import strategies_for, supported_classes

        name = type(denoiser).__name__
        needs = " or ".join(capability.value for capability in cls.needs) or "a description of the model's layers"
        lacks = f"the {family.name} family does not declare" if family.described else "no paradiff family describes"
        return (
            f"strategy='{cls.name}' does not support {name}: it needs {needs}, which {lacks}{cls.refusal_hint}; "
            f"supported: {supported_classes(cls)} ({strategies_for(family)} run {name})"
        )

    @classmethod
    def check_world(cls, degree: int, config: ParallelConfig) -> None:
        """Refuse options that cannot work on ``degree`` ranks per CFG half (nothing to refuse by default)."""

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config: ParallelConfig) -> None:
        """Refuse a model this strategy cannot run over ``degree`` ranks (by default: one of a family it does not
        support, saying what it needs, naming the classes it runs and the strategies that run this one)."""
        if not cls.supports(family):
            raise ParadiffError(cls.refusal(denoiser, family))

    @classmethod
    def check_machine(cls, denoiser: nn.Module) -> None:
        """Refuse a device or an attention backend of this machine the strategy cannot run on (none by default)."""

    def check_height(self, denoiser: nn.Module, degree: int, height: int, vae_scale_factor: int) -> None:
        """Refuse, before any work, a height the strategy cannot cut over ``degree`` ranks (by default: none)."""

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> Installation:
        """Change ``denoiser`` to run over ``comm``'s ranks; the returned installation undoes it."""
        raise NotImplementedError

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost | PassCost | None:
        """The cost of one step on ``n`` ranks per CFG group of machine ``m``, for the planner; None: no cost
        model (the planner then names the strategy as one it cannot predict)."""
        return None

    @classmethod
    def has_cost_model(cls) -> bool:
        return cls.step_cost.__func__ is not Strategy.step_cost.__func__

    @classmethod
    def predicted_exact(cls, synced: int, iterations: int, blocks) -> bool:
        """Whether a call whose first ``synced`` of ``iterations`` iterations run in sync equals one device."""
        return not cls.uses_warmup or synced == iterations

    @classmethod
    def plan_refusal(cls, forcing: bool, block_loop: bool) -> str | None:
        """Why a plan cannot predict the strategy on a call of a diffusion-forcing pipeline (``forcing``), or on a
        call that does (or does not) schedule frame blocks (``block_loop``); None when it can."""
        return None

    @classmethod
    def split_options(cls, cfg_parallel: bool) -> dict:
        """The ``cfg_parallel`` keyword ``parallelize`` takes with this strategy: none for the CFG split alone."""
        return {} if cls.cfg_split_alone else {"cfg_parallel": cfg_parallel}
