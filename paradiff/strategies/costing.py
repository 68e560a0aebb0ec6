"""The terms a strategy's cost model is written in, so that each strategy declares its own (``Strategy.step_cost``).

A step's compute is ``FLOPs / rate`` (times the slowdown of every rank computing at once) plus a fixed
overhead per denoiser call; a transfer is ``bytes / bandwidth`` plus a latency per collective; displaced
steps overlap their transfers with compute as far as the machine allows. The planner
(:mod:`paradiff.plan.costs`) builds the :class:`CostMachine` from a traced workload and a hardware profile
and turns the step a strategy returns into a prediction of the whole call.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCost:
    """A strategy's step: during warm-up (``sync``) and after it (``displaced``), and its memory per rank.

    ``fill_s``: seconds a loop with displaced steps pays once (a pipeline of stages that flows from call to
    call fills once); ``chosen``: options the cost model chose itself (a patch count), which the prediction
    runs with.
    """

    sync_s: float
    displaced_s: float
    sync_bytes: float
    displaced_bytes: float
    memory_bytes: float
    fill_s: float = 0.0
    chosen: dict = field(default_factory=dict)

    def loop(self, synced: int, scale: tuple[float, ...]) -> tuple[float, float]:
        """Seconds and bytes of a loop whose first ``synced`` iterations wait for their transfers; iteration ``i``
        costs ``scale[i]`` times a step."""
        seconds = sum(s * (self.sync_s if i < synced else self.displaced_s) for i, s in enumerate(scale))
        nbytes = sum(s * (self.sync_bytes if i < synced else self.displaced_bytes) for i, s in enumerate(scale))
        return seconds + (self.fill_s if synced < len(scale) else 0.0), nbytes


@dataclass(frozen=True)
class PassCost:
    """A loop whose iterations differ (``dualparal``'s): ``(seconds, bytes)`` of each, fresh and displaced."""

    fresh: tuple[tuple[float, float], ...]
    displaced: tuple[tuple[float, float], ...]
    position: tuple[int, ...]
    memory_bytes: float
    chosen: dict = field(default_factory=dict)

    def loop(self, synced: int, scale: tuple[float, ...]) -> tuple[float, float]:
        """Seconds and bytes of the loop whose first ``synced`` iterations of each window run fresh."""
        runs = [(self.fresh if at < synced else self.displaced)[i] for i, at in enumerate(self.position)]
        return sum(s for s, _ in runs), sum(b for _, b in runs)


@dataclass(frozen=True)
class CostSetting:
    """What one predicted setting adds to the machine: the strategy's options, the loop of a
    diffusion-forcing pipeline when the call has one (``paradiff.plan.forcing_loop.BlockLoop``), and how many
    of the loop's iterations are displaced (what a cost paid once is spread over)."""

    options: dict = field(default_factory=dict)
    blocks: object | None = None
    displaced: int = 0


class CostMachine:
    """Compute and transfer times of one step's workload on one machine, for ranks split into ``groups`` CFG groups.

    ``w`` is the step's workload (``paradiff.plan.workload.Workload``): one call's FLOPs and bytes times the calls
    per step; ``one_call`` is one call's. ``calls`` is the denoiser calls one group makes per step: under the CFG
    split a two-call step is one call per group. ``hw`` is a ``paradiff.plan.hardware.Hardware``.
    """

    def __init__(self, workload, hardware, dtype: str, groups: int = 1):
        self.one_call, self.hw, self.dtype, self.groups = workload, hardware, dtype, groups
        self.rate = hardware.rate(dtype)
        self.w = workload.per_step()
        self.calls = max(workload.calls_per_step // groups, 1)
        #: Samples in one of this group's calls: a batched CFG call's halves go one to each group, two-call CFG's
        #: calls each keep their batch.
        self.samples_per_call = max(1, workload.batch * workload.calls_per_step // (groups * self.calls))

    def for_workload(self, workload) -> CostMachine:
        """The same machine and groups for another workload (one block pass of a window, say)."""
        return CostMachine(workload, self.hw, self.dtype, self.groups)

    def compute(self, flops: float, calls: float = 1.0, shared: bool = True) -> float:
        """Seconds of ``flops`` spread over ``calls`` of this group's steps' worth of operations (1: every layer of
        every call once)."""
        slowdown = self.hw.shared_slowdown if shared else 1.0
        per_call = self.hw.call_overhead_s + self.w.kernels * self.hw.launch_s
        return flops / self.rate * slowdown + calls * self.calls * per_call

    def transfer(self, nbytes: float, exchanges: float) -> float:
        return nbytes / self.hw.link_bytes_per_s + exchanges * self.hw.link_latency_s

    def displaced(self, compute_s: float, transfer_s: float) -> float:
        return max(compute_s + (1 - self.hw.overlap) * transfer_s, transfer_s)

    @property
    def weights(self) -> float:
        return self.w.params * self.w.itemsize


def balanced_sums(costs: tuple[float, ...], parts: int) -> list[float]:
    """The costs of ``parts`` contiguous groups of ``costs`` whose largest is smallest (greedy on the running sum)."""
    total, groups, current = sum(costs), [], 0.0
    for index, cost in enumerate(costs):
        target = total * (len(groups) + 1) / parts  # where this group should end, counted from the first
        remaining_units, remaining_parts = len(costs) - index, parts - len(groups)
        if current and (sum(groups) + current + cost / 2 > target or remaining_units < remaining_parts):
            groups.append(current)
            current = 0.0
        current += cost
    groups.append(current)
    return groups + [0.0] * (parts - len(groups))


def cut_ends(costs: tuple[float, ...], parts: int) -> list[int]:
    """Index of the last unit of each group of :func:`balanced_sums` but the last."""
    sums, running, ends = balanced_sums(costs, parts), 0.0, []
    for index, cost in enumerate(costs):
        running += cost
        if len(ends) < parts - 1 and abs(running - sum(sums[: len(ends) + 1])) < 1e-6 * max(running, 1):
            ends.append(index)
    return ends


def crossing_bytes(w, last: int) -> float:
    """Bytes of the unit outputs up to unit ``last`` that a later unit reads (the next one, or U-Net skips)."""
    return sum(w.unit_output_bytes[i] for i in range(last + 1) if w.unit_last_reader[i] > last)
