"""Measure this machine for the cost model, on the ranks a plan is for, with the model itself.

Every figure comes from a short timing (a few denoiser calls and transfers, seconds in all):

* the compute rate and the per-call overhead: rank 0 alone times the denoiser on the pipeline's own inputs
  at the asked size and at 1/N of its rows, and solves ``t = FLOPs / rate + overhead`` for both;
* the slowdown of every rank computing at once: all ranks time the whole call together;
* the link: all-gathers of 4 bytes (latency) and of several MB (bandwidth) over the process group;
* the overlap: a denoiser call while an all-gather of a displaced step's bytes runs in the background,
  against the two one after the other;
* the call outside the loop: the time until the first denoiser call (prompt encoding) and the rest of a
  two-step call with the denoiser skipped (the VAE decode; not one step, which some pipelines run apart).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .hardware import MEASURED, Hardware

#: Repeats of each timing (the fastest counts: this machine's speed drifts).
REPEATS = 2
#: Bytes of the transfers that measure the link and the overlap.
LINK_BYTES = 8 * 2**20
#: The most transfers the overlap timing runs behind one call.
OVERLAP_TRANSFERS = 32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(run: Callable[[], object], device: torch.device, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _link(device: torch.device, nproc: int) -> tuple[float, float]:
    """(bytes/s one rank sends, seconds per collective) of this process group's all-gather."""
    small = torch.zeros(1, device=device)
    big = torch.zeros(LINK_BYTES // 4, device=device)
    pieces_small = [torch.empty_like(small) for _ in range(nproc)]
    pieces_big = [torch.empty_like(big) for _ in range(nproc)]
    dist.all_gather(pieces_big, big)  # the connections' first use out of the timing
    latency = fastest(lambda: [dist.all_gather(pieces_small, small) for _ in range(10)], device) / 10
    transfer = fastest(lambda: dist.all_gather(pieces_big, big), device)
    sent = LINK_BYTES * (nproc - 1)
    return sent / max(transfer - latency, 1e-9), latency


def _overlap(
    call: Callable[[], object],
    device: torch.device,
    link_device: torch.device,
    nproc: int,
    alone_s: float,
    link_s: float,
) -> float:
    """Share of background all-gathers' time (of tensors on ``link_device``) that a denoiser call running meanwhile
    on ``device`` hides: as many all-gathers as take about half the call (at least one), so that the call's own
    jitter does not swamp them. The ranks timed the call and the link apart, so they agree on the count first
    (the most any rank wants): every rank must issue the same all-gathers."""
    big = torch.zeros(LINK_BYTES // 4, device=link_device)
    pieces = [torch.empty_like(big) for _ in range(nproc)]
    wanted = torch.tensor([max(1, min(OVERLAP_TRANSFERS, round(alone_s / 2 / link_s)))], device=link_device)
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
    count = int(wanted.item())

    def both():
        works = [dist.all_gather(pieces, big, async_op=True) for _ in range(count)]
        call()
        for work in works:
            work.wait()

    dist.barrier()
    together = fastest(both, device)
    return min(max((alone_s + count * link_s - together) / (count * link_s), 0.0), 1.0)


def calibrate(
    denoise_full: Callable[[], object],
    denoise_part: Callable[[], object],
    flops_full: float,
    flops_part: float,
    dtype: str,
    device: torch.device,
) -> Hardware:
    """This machine as the cost model sees it; a collective: call it on every rank of the default group."""
    nproc, rank = dist.get_world_size(), dist.get_rank()
    full = part = 0.0
    if rank == 0:
        denoise_full()  # first-call allocations out of the timing
        full, part = fastest(denoise_full, device), fastest(denoise_part, device)
    dist.barrier()
    shared = fastest(denoise_full, device)
    link_device = device if dist.get_backend() == "nccl" else torch.device("cpu")  # gloo moves host memory
    bandwidth, latency = _link(link_device, nproc)
    link_s = LINK_BYTES * (nproc - 1) / bandwidth + latency
    overlap = _overlap(denoise_full, device, link_device, nproc, shared, link_s)
    memory = device_memory(device) or 0.0
    figures = [full, part, shared, bandwidth, latency, overlap, memory]
    figures = torch.tensor(figures, dtype=torch.float64, device=link_device)
    gathered = [torch.empty_like(figures) for _ in range(nproc)]
    dist.all_gather(gathered, figures)
    full, part = float(gathered[0][0]), float(gathered[0][1])
    shared = max(float(g[2]) for g in gathered)
    bandwidth = min(float(g[3]) for g in gathered)
    latency = max(float(g[4]) for g in gathered)
    overlap = min(float(g[5]) for g in gathered)
    memory = min(float(g[6]) for g in gathered)
    rate = (flops_full - flops_part) / max(full - part, 1e-9)
    overhead = max(full - flops_full / rate, 0.0)
    if overhead == 0.0 or rate <= 0:
        rate, overhead = flops_full / full, 0.0
    return Hardware(
        name=MEASURED,
        flops_per_s={dtype: rate},
        call_overhead_s=overhead,
        link_bytes_per_s=bandwidth,
        link_latency_s=latency,
        overlap=overlap,
        shared_slowdown=max(shared / full, 1.0),
        source=f"measured on {nproc} ranks on {device.type}",
        memory_bytes=memory or None,
    )


def device_memory(device: torch.device) -> float | None:
    """Bytes of memory ``device`` holds: a CUDA device's total; None elsewhere (a CPU rank's share of the host's
    memory is not its own)."""
    if device.type != "cuda":
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)
