"""Each strategy's predicted call (time, bytes per step, memory per rank), from a workload and a machine.

Every strategy declares its own step's cost (``Strategy.step_cost``, in :mod:`paradiff.strategies.costing`'s
terms): this module runs the loop around it. Warm-up steps (the first and ``warmup_steps`` more) wait for their
transfers; displaced steps overlap them with compute as far as the machine allows (:attr:`Hardware.overlap`).
Under the CFG split each group computes half the batch and the halves' predictions are gathered; a pipeline that
makes two calls per step (two-call CFG, :attr:`Workload.calls_per_step`) costs twice one call's compute, bytes and
exchanges per step, and under the CFG split each group makes one of the two calls. The loop of a
diffusion-forcing pipeline (:mod:`paradiff.plan.forcing_loop`) replaces the steps by its iterations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ParadiffError
from ..strategies import strategy_class, strategy_names
from ..strategies.costing import CostMachine, CostSetting
from .forcing_loop import BlockLoop
from .hardware import Hardware
from .workload import Workload


def always_exact(strategy: str) -> bool:
    """Whether ``strategy``'s result equals one device's whatever the warm-up (the strategy itself says so)."""
    return not strategy_class(strategy).uses_warmup


@dataclass(frozen=True)
class Fixed:
    """The parts of a pipeline call outside the denoising loop, on one device (seconds)."""

    encode_s: float = 0.0
    decode_s: float = 0.0
    #: Whether the VAE decode is banded over the ranks (else one rank decodes).
    decode_banded: bool = True


@dataclass(frozen=True)
class Prediction:
    """One setting's predicted call on ``nproc`` ranks."""

    strategy: str
    warmup_steps: int
    nproc: int
    cfg_parallel: bool
    #: Mean seconds per denoising step, and seconds of the whole call (prompt encoding and decode included).
    predicted_step_s: float
    predicted_total_s: float
    #: One device's call time over this one's.
    predicted_speedup: float
    #: What the busiest rank sends per step, the mean over the call's steps (as ``comm_stats`` counts it).
    bytes_per_step: float
    #: Weights and strategy buffers one rank holds (activations aside).
    memory_mb: float
    #: Whether the result equals one device's within float round-off.
    exact: bool
    #: Whether ``memory_mb`` fits in one rank's device memory (True when the machine's memory is not known).
    fits: bool = True
    #: Strategy options this setting runs with, beyond the warm-up and the CFG split (``parallelize``'s keywords).
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        options = "".join(f" {name}={value}" for name, value in self.options.items())
        return f"{self.strategy}{options}{' + cfg_parallel' if self.cfg_parallel else ''}"

    def parallelize_options(self) -> dict:
        """The keywords of the ``paradiff.parallelize`` call that runs this setting (``strategy`` included)."""
        split = strategy_class(self.strategy).split_options(self.cfg_parallel)
        return {"strategy": self.strategy, "warmup_steps": self.warmup_steps, **split, **self.options}


def decode_fixed(cost: tuple[float, int, str] | None, hardware: Hardware, banded: bool = True) -> Fixed:
    """The parts outside the loop from the decode's ``(FLOPs, operations, dtype)`` (None: nothing is costed)."""
    if cost is None:
        return Fixed()
    flops, kernels, dtype = cost
    return Fixed(decode_s=flops / hardware.rate(dtype) + kernels * hardware.launch_s, decode_banded=banded)


def call_s(workload: Workload, hardware: Hardware, dtype: str, share: float = 1.0) -> float:
    """Seconds of one denoiser call on one device alone, over ``share`` of its tokens (1/N: one rank's band)."""
    overhead = hardware.call_overhead_s + workload.kernels * hardware.launch_s
    return workload.flops * share / hardware.rate(dtype) + overhead


def one_device_step(workload: Workload, hardware: Hardware, dtype: str) -> float:
    """Seconds of one denoising step (every call of it) on one device."""
    m = CostMachine(workload, hardware, dtype)
    return m.compute(m.w.flops, shared=False)


def modelled(strategy: str) -> bool:
    """Whether ``strategy`` declares a cost model the planner can predict it with."""
    return strategy_class(strategy).has_cost_model()


def modelled_strategies() -> tuple[str, ...]:
    """The registered strategies the planner predicts, in the registry's order."""
    return tuple(name for name in strategy_names() if modelled(name))


def predict(
    workload: Workload,
    hardware: Hardware,
    dtype: str,
    strategy: str,
    nproc: int,
    steps: int,
    warmup_steps: int,
    cfg_parallel: bool = False,
    fixed: Fixed = Fixed(),
    blocks: BlockLoop | None = None,
    **options,
) -> Prediction:
    """The predicted call of ``strategy`` (with its ``options``) on ``nproc`` ranks against one device, for ``steps``
    steps.

    ``blocks``: the loop of a diffusion-forcing pipeline (``workload`` is then its window's call); its
    iterations replace ``steps``, and ``dualparal`` needs it.
    """
    cls = strategy_class(strategy)
    if not modelled(strategy):
        raise ParadiffError(no_cost_model(strategy))
    split = cfg_parallel and not cls.cfg_split_alone
    groups = 2 if split or cls.cfg_split_alone else 1
    m = CostMachine(workload, hardware, dtype, groups)
    n = nproc // groups
    iterations = blocks.iterations if blocks is not None else steps
    scale = blocks.scale if blocks is not None else (1.0,) * steps  # one device's cost of each, in window calls
    synced = iterations if always_exact(strategy) else min(iterations, warmup_steps + 1)
    step = cls.step_cost(m, n, CostSetting(options, blocks, iterations - synced))
    options = {**options, **step.chosen}
    cfg_bytes = m.w.latent_bytes / 2 if split else 0.0  # a group's predictions
    cfg_gather = m.transfer(cfg_bytes, 1) if cfg_bytes else 0.0
    loop_s, loop_bytes = step.loop(synced, scale)
    loop = loop_s + sum(scale) * cfg_gather
    decode = fixed.decode_s * hardware.shared_slowdown / nproc if fixed.decode_banded else fixed.decode_s
    total = fixed.encode_s + loop + decode
    alone = fixed.encode_s + sum(scale) * one_device_step(workload, hardware, dtype) + fixed.decode_s
    defaults = cls.Options()
    return Prediction(
        strategy=strategy,
        warmup_steps=warmup_steps,
        nproc=nproc,
        cfg_parallel=split,
        predicted_step_s=loop / iterations,
        predicted_total_s=total,
        predicted_speedup=alone / total,
        bytes_per_step=loop_bytes / iterations + cfg_bytes,
        memory_mb=step.memory_bytes / 2**20,
        exact=cls.predicted_exact(synced, iterations, blocks),
        fits=hardware.fits(step.memory_bytes),
        options={name: value for name, value in options.items() if getattr(defaults, name) != value},
    )


def no_cost_model(strategy: str) -> str:
    return (
        f"strategy {strategy!r} declares no cost model (Strategy.step_cost), so a plan cannot predict it; "
        f"plan predicts {', '.join(modelled_strategies())}"
    )
