"""Each strategy's time per step, bytes per step and memory per rank, from a workload and a machine.

A step's compute is ``FLOPs / rate`` (times the slowdown of every rank computing at once) plus a fixed
overhead per denoiser call. A transfer is ``bytes / bandwidth`` plus a latency per collective. Warm-up
steps (the first and ``warmup_steps`` more) wait for their transfers; displaced steps overlap them with
compute as far as the machine allows (:attr:`Hardware.overlap`). What each strategy computes and sends:

* ``patch``: 1/N of every layer's tokens; the keys and values of every image attention layer gathered
  from the other bands ((N−1)/N of them), a halo row above and below each 3×3 convolution, a
  statistics exchange per GroupNorm, and the bands of the prediction gathered.
* ``ulysses`` / ``ring``: the same compute, exact every step, nothing overlapped: Ulysses's four
  all-to-alls per attention layer move 2·(N−1)/N² of its keys and values; the ring passes 1/N of them
  N−1 times; the prediction's bands are gathered.
* ``pipefusion``: 1/N of the blocks over M patches in M + N − 1 slots (the pipeline fills and drains
  every call); embeddings and head on every rank; each stage passes its patch's hidden states on.
* ``parastep``: warm-up steps on every rank alike; then rounds of N steps, one call per rank, and the
  predictions gathered.
* ``asyncdiff``: warm-up steps whole on every rank, sending nothing; then each rank runs one component
  (the contiguous cut of the units into N of about equal FLOPs), sends the hidden states that cross its
  border, and the last component's prediction is broadcast. At stride 2, N − 1 components complete two
  steps per round, and the extra rank's prediction and the look-ahead one are both broadcast.
* ``dualparal`` (a diffusion-forcing pipeline's loop, :mod:`paradiff.plan.frame_blocks`): each call runs
  one pass of a frame block per block in flight (fresh: one more per block just finished) through 1/N of
  the blocks, in passes + N − 1 slots; the embeddings and head run per pass on every rank; each pass's
  hidden states go to the next stage, and the last stage sends the prediction of the blocks in flight to
  every rank. One device runs the whole window at every iteration, and the loop is the pipeline's
  iterations, not its steps.
* the CFG split: each group computes half the batch; the halves' predictions are gathered.

A pipeline that makes two calls per step (two-call CFG, :attr:`Workload.calls_per_step`) costs twice one
call's compute, bytes and exchanges per step; under the CFG split each group makes one of the two calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..strategies import strategy_class
from .frame_blocks import BlockLoop
from .hardware import Hardware
from .workload import Workload

#: Strategies :func:`predict` models.
MODELLED = ("patch", "pipefusion", "parastep", "asyncdiff", "cfg", "ulysses", "ring", "dualparal")


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
    #: Strategy options this setting runs with, beyond the warm-up and the CFG split (``parallelize``'s keywords).
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        options = "".join(f" {name}={value}" for name, value in self.options.items())
        return f"{self.strategy}{options}{' + cfg_parallel' if self.cfg_parallel else ''}"


@dataclass(frozen=True)
class _Step:
    """A strategy's step: during warm-up (``sync``) and after it (``displaced``)."""

    sync_s: float
    displaced_s: float
    sync_bytes: float
    displaced_bytes: float
    memory_bytes: float

    def loop(self, synced: int, scale: tuple[float, ...]) -> tuple[float, float]:
        """Seconds and bytes of a loop whose first ``synced`` iterations wait for their transfers; iteration ``i``
        costs ``scale[i]`` times a step."""
        seconds = sum(s * (self.sync_s if i < synced else self.displaced_s) for i, s in enumerate(scale))
        nbytes = sum(s * (self.sync_bytes if i < synced else self.displaced_bytes) for i, s in enumerate(scale))
        return seconds, nbytes


@dataclass(frozen=True)
class _Passes:
    """``dualparal``'s iterations, which differ: ``(seconds, bytes)`` of each, fresh and displaced."""

    fresh: tuple[tuple[float, float], ...]
    displaced: tuple[tuple[float, float], ...]
    position: tuple[int, ...]
    memory_bytes: float

    def loop(self, synced: int, scale: tuple[float, ...]) -> tuple[float, float]:
        """Seconds and bytes of the loop whose first ``synced`` iterations of each window run fresh."""
        chosen = [(self.fresh if at < synced else self.displaced)[i] for i, at in enumerate(self.position)]
        return sum(s for s, _ in chosen), sum(b for _, b in chosen)


class _Machine:
    """Compute and transfer times of one step's workload on one machine, for ranks split into ``groups`` CFG groups.

    ``w`` is the step's workload: one call's FLOPs and bytes times the calls per step. ``calls`` is the denoiser
    calls one group makes per step: under the CFG split a two-call step is one call per group.
    """

    def __init__(self, workload: Workload, hardware: Hardware, dtype: str, groups: int = 1):
        self.one_call, self.hw, self.rate = workload, hardware, hardware.rate(dtype)
        self.w = workload.per_step()
        self.calls = max(workload.calls_per_step // groups, 1)

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
    m = _Machine(workload, hardware, dtype)
    return m.compute(m.w.flops, shared=False)


def _patch(m: _Machine, groups: int, n: int) -> _Step:
    w = m.w
    compute = m.compute(w.flops / groups / n)
    nbytes = (w.kv_bytes + 2 * w.halo_row_bytes + w.latent_bytes) / groups * (n - 1) / n
    transfer = m.transfer(nbytes, m.calls * (w.attention_layers + w.convolutions + w.group_norms + 1))
    return _Step(compute + transfer, m.displaced(compute, transfer), nbytes, nbytes, m.weights + w.kv_bytes / groups)


def _sequence(m: _Machine, groups: int, n: int, ring: bool) -> _Step:
    w = m.w
    compute = m.compute(w.flops / groups / n)
    kv = w.kv_bytes / groups
    nbytes = kv * (n - 1) / n if ring else 2 * kv * (n - 1) / n**2
    nbytes += w.latent_bytes / groups * (n - 1) / n  # the bands of the prediction, gathered
    exchanges = w.attention_layers * ((n - 1) if ring else 4) + 1
    step = compute + m.transfer(nbytes, m.calls * exchanges)
    return _Step(step, step, nbytes, nbytes, m.weights)


def balanced_cut(costs: tuple[float, ...], parts: int) -> list[float]:
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


def _cut_indices(costs: tuple[float, ...], parts: int) -> list[int]:
    """Index of the last unit of each group of :func:`balanced_cut` but the last."""
    sums, running, ends = balanced_cut(costs, parts), 0.0, []
    for index, cost in enumerate(costs):
        running += cost
        if len(ends) < parts - 1 and abs(running - sum(sums[: len(ends) + 1])) < 1e-6 * max(running, 1):
            ends.append(index)
    return ends


def crossing_bytes(w: Workload, last: int) -> float:
    """Bytes of the unit outputs up to unit ``last`` that a later unit reads (the next one, or U-Net skips)."""
    return sum(w.unit_output_bytes[i] for i in range(last + 1) if w.unit_last_reader[i] > last)


def _asyncdiff(m: _Machine, groups: int, n: int, stride: int = 1) -> _Step:
    """Stride 2: ``n − 1`` components, and a round of two steps (the second reads the look-ahead prediction)."""
    w = m.w
    parts = n - (stride - 1)
    outside = (w.flops - w.stack_flops) / groups
    components = balanced_cut(tuple(f / groups for f in w.unit_flops), parts)
    components[0] += outside
    compute = m.compute(max(components))
    sent = [crossing_bytes(w, last) / groups for last in _cut_indices(w.unit_flops, parts)]
    predictions = [w.latent_bytes / groups * (n - 1)] * stride  # this step's (and the look-ahead) to every rank
    nbytes = max([*sent, *predictions])
    transfer = m.transfer((sum(sent) + sum(predictions)) / n, 2 * stride * m.calls)
    whole = m.compute(w.flops / groups)
    per_step = nbytes / stride  # warm-up sends nothing, and comm_stats averages over the steps that sent
    return _Step(whole, m.displaced(compute, transfer) / stride, per_step, per_step, m.weights)


def default_patches(token_rows: int, stages: int) -> int:
    """``pipefusion``'s default patch count: the divisor of the token rows nearest twice the stages."""
    divisors = [d for d in range(stages, token_rows + 1) if token_rows % d == 0] or [token_rows]
    return min(divisors, key=lambda d: (abs(d - 2 * stages), d))


def _pipefusion(m: _Machine, groups: int, n: int, patches: int | None) -> _Step:
    w = m.w
    patches = patches or default_patches(w.token_rows, n)
    stage = max(balanced_cut(tuple(f / groups for f in w.unit_flops), n))
    outside = (w.flops - w.stack_flops) / groups
    boundary = max(w.unit_output_bytes, default=0.0) / groups
    sync = m.compute(w.flops / groups, shared=False) + m.transfer(boundary * (n - 1), m.calls * (n - 1))
    slots = patches + n - 1
    compute = slots * m.compute(stage / patches, calls=1 / n) + m.compute(outside, calls=0)
    nbytes = boundary
    transfer = m.transfer(nbytes, m.calls * patches)
    weights = (w.params - w.stack_params + w.stack_params / n) * w.itemsize
    return _Step(sync, m.displaced(compute, transfer), nbytes, nbytes, weights + w.kv_bytes / groups / n)


def _parastep(m: _Machine, groups: int, n: int) -> _Step:
    w = m.w
    call = m.compute(w.flops / groups)
    one = m.one_call
    guided = one.latent_bytes / (2 if one.batch % 2 == 0 else 1)  # the latents after CFG combined the halves
    nbytes = guided / groups * (n - 1)  # each round: this rank's step, to the others
    per_step = (call + m.transfer(nbytes, 2)) / n
    return _Step(call, per_step, 0.0, nbytes / n, m.weights)


def _dualparal(m: _Machine, b: _Machine, groups: int, n: int, loop: BlockLoop) -> _Passes:
    """``m``: the window's call (one device's); ``b``: one block pass's traced call, of which ``loop.fraction``."""
    w, f = b.w, loop.fraction
    stage = b.compute(w.stack_flops * f / groups / n, calls=1 / n)
    outside = b.compute((w.flops - w.stack_flops) * f / groups, calls=0)  # embeddings and head, every pass
    hidden = max(w.unit_output_bytes, default=0.0) * f / groups
    prediction = w.latent_bytes * f / groups * (n - 1)

    def iteration(flight: int, done: int) -> tuple[float, float]:
        passes = flight + done
        compute = (passes + n - 1) * stage + passes * outside
        nbytes = max(passes * hidden, flight * prediction)  # a stage's hidden states; the last one's predictions
        return b.displaced(compute, b.transfer(nbytes, 2 * b.calls * passes)), nbytes

    fresh = tuple(iteration(flight, done) for flight, done in zip(loop.in_flight, loop.finished, strict=True))
    displaced = tuple(iteration(flight, 0) for flight in loop.in_flight)
    weights = (m.w.params - m.w.stack_params + m.w.stack_params / n) * m.w.itemsize
    return _Passes(fresh, displaced, loop.position, weights)


def _cfg_only(m: _Machine) -> _Step:
    w = m.w
    nbytes = w.latent_bytes / 2
    step = m.compute(w.flops / 2) + m.transfer(nbytes, 1)
    return _Step(step, step, nbytes, nbytes, m.weights)


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
    pipefusion_patches: int | None = None,
    blocks: BlockLoop | None = None,
    asyncdiff_stride: int = 1,
) -> Prediction:
    """The predicted call of ``strategy`` on ``nproc`` ranks against one device, for ``steps`` steps.

    ``blocks``: the loop of a diffusion-forcing pipeline (``workload`` is then its window's call); its
    iterations replace ``steps``, and ``dualparal`` needs it.
    """
    groups = 2 if cfg_parallel or strategy == "cfg" else 1
    m = _Machine(workload, hardware, dtype, groups)
    n = nproc // groups
    iterations = blocks.iterations if blocks is not None else steps
    scale = blocks.scale if blocks is not None else (1.0,) * steps  # one device's cost of each, in window calls
    if strategy == "cfg":
        step = _cfg_only(m)
    elif strategy == "patch":
        step = _patch(m, groups, n)
    elif strategy in ("ulysses", "ring"):
        step = _sequence(m, groups, n, ring=strategy == "ring")
    elif strategy == "asyncdiff":
        step = _asyncdiff(m, groups, n, asyncdiff_stride)
    elif strategy == "pipefusion":
        step = _pipefusion(m, groups, n, pipefusion_patches)
    elif strategy == "parastep":
        step = _parastep(m, groups, n)
    elif strategy == "dualparal" and blocks is not None:
        step = _dualparal(m, _Machine(blocks.block, hardware, dtype, groups), groups, n, blocks)
    else:
        raise ValueError(f"no cost model for strategy {strategy!r}{' without its block loop' * (blocks is None)}")
    cfg_bytes = m.w.latent_bytes / 2 if groups == 2 and strategy != "cfg" else 0.0  # a group's predictions
    cfg_gather = m.transfer(cfg_bytes, 1) if cfg_bytes else 0.0
    synced = iterations if always_exact(strategy) else min(iterations, warmup_steps + 1)
    loop_s, loop_bytes = step.loop(synced, scale)
    loop = loop_s + sum(scale) * cfg_gather
    decode = fixed.decode_s * hardware.shared_slowdown / nproc if fixed.decode_banded else fixed.decode_s
    total = fixed.encode_s + loop + decode
    alone = fixed.encode_s + sum(scale) * one_device_step(workload, hardware, dtype) + fixed.decode_s
    exact = always_exact(strategy) or synced == iterations
    if strategy == "dualparal":  # fresh (every window), it equals one device with blocks seeing their predecessor only
        exact = max(blocks.position) < synced and blocks.blocks <= 2
    return Prediction(
        strategy=strategy,
        warmup_steps=warmup_steps,
        nproc=nproc,
        cfg_parallel=cfg_parallel and strategy != "cfg",
        predicted_step_s=loop / iterations,
        predicted_total_s=total,
        predicted_speedup=alone / total,
        bytes_per_step=loop_bytes / iterations + cfg_bytes,
        memory_mb=step.memory_bytes / 2**20,
        exact=exact,
        options={"asyncdiff_stride": asyncdiff_stride} if asyncdiff_stride != 1 else {},
    )
