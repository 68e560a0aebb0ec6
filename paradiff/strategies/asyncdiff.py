"""Asynchronous model-component parallelism (``asyncdiff``, AsyncDiff): each rank runs one component of the denoiser.

The denoiser's units (a DiT's blocks; a U-Net's down blocks, mid block and up blocks) are cut into N
contiguous components of about equal cost, measured on the first warm-up call of the first ``pipe(...)``
call (each unit timed on the real inputs, the times averaged over the ranks), or as ``asyncdiff_cut``
says. Every rank holds the whole model. Warm-up calls run the whole model on every rank (exact). After
warm-up, component n at step t takes component n−1's output of step t−1, so all components run at once;
U-Net skip features that cross a component border come from the previous step the same way
(``paradiff.layers.components``). Each rank sends only its component's outputs that another component
reads, as soon as they exist (``paradiff.runtime.component_link``); the last component's prediction is
broadcast at the end of each step, so that every rank's scheduler runs on the same one.

Stride 2 runs N components on N + 1 ranks and completes two steps per parallel round.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import ParadiffError
from ..layers.components import ComponentCall, ComponentCallHook, UnitHook
from ..models import Capability, DenoiserFamily
from ..runtime.comm import Communicator
from ..stages.cut import balanced_cut, mean_over_ranks
from .base import Strategy, StrategyOptions, is_counts
from .costing import CostMachine, CostSetting, StepCost, balanced_sums, crossing_bytes, cut_ends
from .installation import Installation


@dataclass(frozen=True)
class AsyncDiffOptions(StrategyOptions):
    """
    Attributes:
        asyncdiff_stride: 1: N components on N ranks, one step per parallel round. 2: N components on N + 1 ranks,
            two steps per round (the components run at the next step's timestep while the extra rank runs the last
            component at this step's).
        asyncdiff_cut: number of units (a DiT's blocks; a U-Net's down, mid and up blocks) of each component, in
            forward order; ``None`` (default): contiguous components of about equal measured cost.
    """

    asyncdiff_stride: int = 1
    asyncdiff_cut: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.asyncdiff_stride not in (1, 2) or isinstance(self.asyncdiff_stride, bool):
            raise ParadiffError(f"asyncdiff_stride must be 1 or 2, got {self.asyncdiff_stride!r}")
        cut = self.asyncdiff_cut
        if cut is not None:
            if not is_counts(cut, 1):
                raise ParadiffError(
                    f"asyncdiff_cut must be None or the number of units of each component (integers >= 1), got {cut!r}"
                )
            object.__setattr__(self, "asyncdiff_cut", tuple(cut))


class AsyncDiffInstallation(Installation):
    """The hooks of :class:`AsyncDiffStrategy`, and the components' call state they share."""

    def __init__(self, model: nn.Module, strategy: str, call: ComponentCall):
        super().__init__(model, strategy)
        self.call = call

    @property
    def cut(self) -> tuple[int, ...] | None:
        """Units per component, once known (given, or measured on the first call)."""
        return self.call.plan.cut if self.call.plan is not None else None

    def layout(self) -> dict:
        """The cut, measured or given: it decides which stale outputs each component reads, so the pictures."""
        return {"asyncdiff_cut": list(self.cut)} if self.cut is not None else {}

    def adopt(self, layout: dict) -> bool:
        """Take ``layout``'s cut where none is measured yet; a layout without a cut does not hold for components."""
        cut = layout.get("asyncdiff_cut")
        if self.cut is None and cut is not None:
            self.call.set_cut(tuple(cut))
        return self.cut is not None and layout == self.layout()


def components_for(degree: int, stride: int) -> int:
    """Components run on ``degree`` ranks: one per rank, less the extra rank of stride 2."""
    return degree - (stride - 1)


class AsyncDiffStrategy(Strategy):
    name = "asyncdiff"
    refreshes = "per call"
    call_split = "blocks"
    Options = AsyncDiffOptions
    needs = (Capability.COMPONENTS,)
    world = "world = its components, + 1 with asyncdiff_stride=2"

    #: A plan also predicts stride 2, on 3 ranks or more.
    plan_variants = (((("asyncdiff_stride", 2),), 3),)

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """Warm-up steps whole on every rank, sending nothing; then each rank runs one component (the contiguous
        cut of the units into N of about equal FLOPs), sends the hidden states that cross its border, and the
        last component's prediction is broadcast. At stride 2, N − 1 components complete two steps per round,
        and the extra rank's prediction and the look-ahead one are both broadcast."""
        w, groups = m.w, m.groups
        stride = setting.options.get("asyncdiff_stride", 1)
        parts = n - (stride - 1)
        components = balanced_sums(tuple(f / groups for f in w.unit_flops), parts)
        components[0] += (w.flops - w.stack_flops) / groups
        compute = m.compute(max(components))
        sent = [crossing_bytes(w, last) / groups for last in cut_ends(w.unit_flops, parts)]
        predictions = [w.latent_bytes / groups * (n - 1)] * stride  # this step's (and the look-ahead) to every rank
        transfer = m.transfer((sum(sent) + sum(predictions)) / n, 2 * stride * m.calls)
        per_step = max([*sent, *predictions]) / stride  # warm-up sends nothing; comm_stats averages the steps that do
        whole = m.compute(w.flops / groups)
        return StepCost(whole, m.displaced(compute, transfer) / stride, per_step, per_step, m.weights)

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        """Refuse, before any collective, a model, world or cut that cannot form the components."""
        name, stride = type(denoiser).__name__, config.options.asyncdiff_stride
        units = family.component_units(denoiser) if cls.supports(family) else None
        if units is None:
            raise ParadiffError(cls.refusal(denoiser, family))
        components, count = components_for(degree, stride), len(units.units)
        per_half = " per CFG half" if config.cfg_parallel else ""
        if components < 2:
            raise ParadiffError(
                f"strategy='asyncdiff' with asyncdiff_stride={stride} runs N >= 2 components on N + {stride - 1} ranks"
                f"{per_half}, got {degree}; launch {2 + stride - 1} or more ranks{per_half}"
                + (", or use asyncdiff_stride=1" if stride == 2 else "")
            )
        if count < components:
            raise ParadiffError(
                f"strategy='asyncdiff' gives each of its {components} components at least one block, but this {name} "
                f"has {count} ({', '.join(n for n, _ in units.units)}); run at most {count + stride - 1} ranks"
                f"{per_half}"
            )
        cut = config.options.asyncdiff_cut
        if cut is not None and (len(cut) != components or sum(cut) != count):
            raise ParadiffError(
                f"asyncdiff_cut={list(cut)} gives {len(cut)} components of {sum(cut)} blocks, but asyncdiff_stride="
                f"{stride} on {degree} ranks{per_half} runs {components} components and this {name} has {count} "
                f"blocks ({', '.join(n for n, _ in units.units)}); give {components} block counts adding up to {count}"
            )

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> AsyncDiffInstallation:
        """Hook ``denoiser``'s units to run as components, one per rank."""
        units = family.component_units(denoiser)
        stride, cut = self.options.asyncdiff_stride, self.options.asyncdiff_cut
        components = components_for(comm.size, stride)

        def choose_cut(seconds: list[float]) -> tuple[int, ...]:
            return balanced_cut(mean_over_ranks(seconds, comm), components)

        call = ComponentCall(comm, units, stride, choose_cut)
        if cut is not None:
            call.set_cut(cut)
        installed = AsyncDiffInstallation(denoiser, self.name, call)
        installed.hook(denoiser, ComponentCallHook(family, call))
        for index, (_, unit) in enumerate(units.units):
            installed.hook(unit, UnitHook(call, index))
        return installed.done()
