"""Hooks that run a denoiser cut into components, one per rank, each a step behind the one before (``asyncdiff``).

The denoiser's own forward runs on every rank: embeddings, the loop over its units (blocks), the head.
Each unit carries a :class:`UnitHook`. On a warm-up call every unit runs on every rank (exact: each rank
computes the whole model). On a displaced call only this rank's component's units run; every other unit
returns its latest known output instead: for the units whose outputs this component reads (the previous
component's last unit, U-Net skip features) that is the output computed one call earlier by the rank
that owns it, received in the background; for the rest it is a placeholder of the right shape that no
computed unit reads. The head then runs on the placeholders too (cheap), and the denoiser's hook replaces
the output with the last component's, broadcast from its rank.

Stride 2 (one more rank than components): a parallel round spans two steps. On the round's first call the
components run on ranks 0..N−1 at the *next* step's timestep (extrapolated from the last two timesteps,
since the denoiser is never told the schedule), while the extra rank runs the last component at this
step's timestep; its output is this step's prediction, the last component's look-ahead output is the next
step's. The round's second call computes nothing.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from diffusers.hooks import ModelHook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..compat import CallContextHook
from ..errors import ParadiffError
from ..models.base import ComponentUnits, DenoiserFamily, bind_inputs
from ..runtime.comm import Communicator
from ..runtime.component_link import TENSORS_PER_UNIT, ComponentLink
from .split import output_sample, replace_output_sample


class Mode(enum.Enum):
    #: Warm-up: every unit runs on every rank (exact).
    WHOLE = "whole"
    #: Displaced: this rank's component runs on last call's inputs from the earlier components.
    COMPONENT = "component"
    #: Stride 2, a round's second call: nothing runs; the prediction computed one call earlier is used.
    AHEAD = "ahead"


@dataclass(frozen=True)
class ComponentPlan:
    """Which units each rank runs, and which unit outputs travel between which ranks; the same on every rank."""

    cut: tuple[int, ...]
    stride: int
    rank: int
    #: Units of this rank's component.
    mine: range
    #: Units of this rank whose outputs other ranks read, and those ranks.
    targets: dict[int, list[int]]
    #: Units of other ranks whose outputs this rank reads, and the rank that sends each.
    sources: dict[int, int]

    @property
    def components(self) -> int:
        return len(self.cut)

    @property
    def output_rank(self) -> int:
        """The rank whose output is this step's prediction: the last component's (stride 2: the extra rank)."""
        return self.components - 1 + (self.stride - 1)

    @property
    def looks_ahead(self) -> bool:
        """Stride 2: this rank runs its component at the next step's timestep."""
        return self.stride == 2 and self.rank < self.components

    @classmethod
    def build(cls, cut: tuple[int, ...], units: ComponentUnits, rank: int, stride: int) -> ComponentPlan:
        bounds = [0, *itertools.accumulate(cut)]
        spans = [range(start, stop) for start, stop in itertools.pairwise(bounds)]
        owner = [c for c, span in enumerate(spans) for _ in span]
        count = len(cut)

        def ranks_of(component: int) -> list[int]:  # stride 2: the extra rank runs the last component too
            return [component, count] if stride == 2 and component == count - 1 else [component]

        def reads(component: int) -> set[int]:
            first = spans[component].start
            skipped = {k for j in spans[component] for k in units.skips.get(j, ()) if owner[k] != component}
            return skipped | ({first - 1} if first > 0 else set())

        targets: dict[int, list[int]] = {}
        for component in range(1, count):
            for unit in sorted(reads(component)):
                targets.setdefault(unit, []).extend(ranks_of(component))
        component = min(rank, count - 1)
        mine = spans[component]
        sources = {unit: owner[unit] for unit in reads(component)}
        own_targets = {unit: sorted(ranks) for unit, ranks in targets.items() if unit in mine and rank < count}
        return cls(cut, stride, rank, mine, own_targets, sources)


@dataclass
class CallRecord:
    """One call context and call slot: its mode, the latest output of every unit, its transfers."""

    link: ComponentLink
    mode: Mode = Mode.WHOLE
    latest: dict[int, object] = field(default_factory=dict)
    previous_timestep: object = None

    def drain(self) -> None:
        self.link.drain()


class ComponentCall:
    """What the hooks of one denoiser share: the plan (once the cut is known) and the current call's record."""

    def __init__(self, comm: Communicator, units: ComponentUnits, stride: int, choose_cut: Callable):
        self.comm, self.units, self.stride = comm, units, stride
        #: ``choose_cut(costs)``: the cut from the units' measured seconds (agreed over the ranks).
        self.choose_cut = choose_cut
        self.plan: ComponentPlan | None = None
        self.record: CallRecord | None = None
        #: Seconds per unit of the timing pass (the first warm-up call), while it runs.
        self.costs: list[float] | None = None

    def set_cut(self, cut: tuple[int, ...]) -> None:
        self.plan = ComponentPlan.build(cut, self.units, self.comm.rank, self.stride)

    def open(self, context: str | None, timestep) -> CallRecord:
        state = self.comm.state
        state.enter_call(context, timestep)
        units = len(self.units.units)
        record = state.exchange("paradiff.asyncdiff.call", lambda: CallRecord(ComponentLink(self.comm, units)))
        displaced = state.displaced_index()
        if self.plan is None or displaced < 0:
            record.mode = Mode.WHOLE
        else:
            record.mode = Mode.AHEAD if displaced % self.stride else Mode.COMPONENT
        self.record = record
        return record


class ComponentCallHook(CallContextHook):
    """On the denoiser: counts the step, picks the call's mode, shares the last component's prediction."""

    def __init__(self, family: DenoiserFamily, call: ComponentCall):
        super().__init__()
        self.family, self.call = family, call

    def pre_forward(self, module, *args, **kwargs):
        call, family = self.call, self.family
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        passed = [name for name in call.units.unsupported_args if inputs.get(name) is not None]
        if passed:
            raise ParadiffError(
                f"strategy='asyncdiff' cannot pass {', '.join(passed)} to the units of {type(module).__name__}; "
                "use strategy='patch' for such calls"
            )
        timestep = inputs[family.timestep_arg]
        record = call.open(self.context.name, timestep)
        previous, record.previous_timestep = record.previous_timestep, timestep
        if record.mode is Mode.WHOLE:
            record.link.drain()  # after displaced calls (a refresh): what they sent is older than what runs now
            call.costs = [0.0] * len(call.units.units) if call.plan is None else None
            return args, kwargs
        if record.mode is Mode.COMPONENT:
            plan = call.plan
            record.link.drain_sends()
            templates = {unit: _tensors(record.latest[unit]) for unit in plan.sources}
            record.link.post_receives(plan.sources, templates)
            if plan.looks_ahead:
                inputs[family.timestep_arg] = timestep + (timestep - previous)
        return bound.args, bound.kwargs

    def post_forward(self, module, output):
        call, record = self.call, self.call.record
        if record.mode is Mode.WHOLE:
            if call.costs is not None:
                call.set_cut(call.choose_cut(call.costs))
                call.costs = None
            return output
        plan, link = call.plan, record.link
        if record.mode is Mode.AHEAD:
            sample = link.take_ahead()
        else:
            sample = link.share(output_sample(output), plan.output_rank)
            if plan.stride == 2:
                link.share_ahead(output_sample(output), plan.components - 1)
        return replace_output_sample(output, sample)


class UnitHook(ModelHook):
    """On every unit: runs it, or returns its latest known output (received from its owner when this rank reads it)."""

    def __init__(self, call: ComponentCall, index: int):
        super().__init__()
        self.call, self.index = call, index

    def new_forward(self, module, *args, **kwargs):
        call, index = self.call, self.index
        record, plan = call.record, call.plan
        if record.mode is Mode.WHOLE:
            start = time.perf_counter()
            output = self.fn_ref.original_forward(*args, **kwargs)
            if call.costs is not None:
                _synchronize(output)
                call.costs[index] += time.perf_counter() - start
            record.latest[index] = output
            return output
        if record.mode is Mode.COMPONENT and index in plan.mine:
            output = self.fn_ref.original_forward(*args, **kwargs)
            record.latest[index] = output
            if index in plan.targets:
                record.link.send(index, _tensors(output), plan.targets[index])
            return output
        if record.mode is Mode.COMPONENT and index in plan.sources:
            received = record.link.received(index)
            if received is not None:
                record.latest[index] = _rebuilt(record.latest[index], received)
        return record.latest[index]


def _tensors(output) -> list[torch.Tensor]:
    """The distinct tensors of a unit's output (a tensor or nested tuples of them, ``None`` entries allowed), in order.

    A U-Net down block returns its output also as its last skip feature: one tensor object, sent once.
    """
    tensors = list({id(leaf): leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)}.values())
    if len(tensors) > TENSORS_PER_UNIT:
        raise ParadiffError(f"a unit returned {len(tensors)} tensors; asyncdiff sends at most {TENSORS_PER_UNIT}")
    return tensors


def _rebuilt(template, tensors: list[torch.Tensor]):
    """``template``'s structure with its distinct tensors replaced, in order, by ``tensors``."""
    leaves, spec = tree_flatten(template)
    fresh = dict(zip((id(t) for t in _tensors(template)), tensors, strict=True))
    return tree_unflatten([fresh.get(id(leaf), leaf) for leaf in leaves], spec)


def _synchronize(output) -> None:
    tensors = _tensors(output)
    if tensors and tensors[0].device.type == "cuda":
        torch.cuda.synchronize(tensors[0].device)
