"""The machine a plan is for: how fast a rank computes, how fast two ranks talk, how much they slow each other.

Either measured here (:func:`paradiff.plan.calibrate.calibrate`) or one of :data:`PROFILES`: published
figures of well-known GPU servers. A profile's compute rate is the dense tensor-core peak times the share
of it diffusion denoisers reach in practice (model FLOPs utilisation); its link is the per-GPU bandwidth
of one direction between two GPUs, at the share collectives reach, and a per-collective latency; its memory
is one GPU's, in GiB as CUDA reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ParadiffError

#: The name of a machine timed here (:func:`paradiff.plan.calibrate.calibrate`), rather than a profile's.
MEASURED = "measured here"


@dataclass(frozen=True)
class Hardware:
    name: str
    #: FLOP/s one rank reaches on a whole denoiser call, by dtype name.
    flops_per_s: dict
    #: Seconds of one denoiser call that do not shrink with its tokens (Python, small ops), measured on this
    #: machine; GPU profiles count kernel launches instead (:attr:`launch_s`).
    call_overhead_s: float
    #: Bytes/s one rank sends to another, and the fixed seconds of one collective.
    link_bytes_per_s: float
    link_latency_s: float
    #: Share of a displaced step's transfers that runs while the rank computes (1: a GPU's copy engines
    #: and NCCL's own streams; less on CPU ranks, where the transfer takes cycles from the same cores).
    overlap: float
    #: How much slower a rank computes while every rank computes (shared memory bandwidth, shared cores).
    shared_slowdown: float
    #: Where the figures come from.
    source: str
    #: Seconds the host takes to launch one kernel: eager PyTorch launches one per operation, and a call whose
    #: kernels are shorter than that waits on the host (small bands of a large model on a fast GPU).
    launch_s: float = 0.0
    #: Bytes of memory one rank's device holds (None: not known, nothing is refused for memory).
    memory_bytes: float | None = None

    def fits(self, nbytes: float) -> bool:
        """Whether ``nbytes`` per rank fit in one rank's device memory (True when it is not known)."""
        return self.memory_bytes is None or nbytes <= self.memory_bytes

    def rate(self, dtype: str) -> float:
        try:
            return self.flops_per_s[dtype]
        except KeyError:
            raise ParadiffError(
                f"hardware {self.name!r} has no figure for {dtype}; use one of {', '.join(self.flops_per_s)}"
            ) from None


#: Share of the dense tensor-core peak a diffusion denoiser reaches on these GPUs (large GEMMs and
#: flash attention, fp16/bf16): about 40-50% is what SDXL/Flux inference reaches in published
#: profiles; 0.45 is used for every profile.
MFU = 0.45
#: Share of a link's nominal one-way bandwidth that all-gathers of a few MB reach (NCCL bus bandwidth).
LINK_EFFICIENCY = 0.7
#: Host time per eager PyTorch operation on a GPU (dispatch and kernel launch): typically 5-10 µs.
LAUNCH_S = 6e-6


def _gpu(name: str, tflops: float, link_gb_s: float, latency_us: float, memory_gib: float, source: str) -> Hardware:
    rate = tflops * 1e12 * MFU
    return Hardware(
        name=name,
        flops_per_s={"float16": rate, "bfloat16": rate, "float32": rate / 2},
        call_overhead_s=0.0,
        launch_s=LAUNCH_S,
        link_bytes_per_s=link_gb_s * 1e9 * LINK_EFFICIENCY,
        link_latency_s=latency_us / 1e6,
        overlap=1.0,
        shared_slowdown=1.0,
        source=source,
        memory_bytes=memory_gib * 2**30,
    )


#: float32 runs as TF32 on the tensor cores, at half the fp16 rate.
PROFILES = {
    profile.name: profile
    for profile in (
        _gpu(
            "a100-nvlink",
            312,
            300,
            15,
            80,
            "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS dense fp16/bf16 tensor, 80 GB HBM2e; NVLink 3: 600 GB/s "
            "per GPU, 300 GB/s each way",
        ),
        _gpu(
            "h100-nvlink",
            989,
            450,
            12,
            80,
            "NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense fp16/bf16 tensor, 80 GB HBM3; NVLink 4: 900 GB/s per GPU, "
            "450 GB/s each way",
        ),
        _gpu(
            "h200-nvlink",
            989,
            450,
            12,
            140,
            "NVIDIA H200 SXM datasheet: 989 TFLOPS dense fp16/bf16 tensor (as the H100; 141 GB HBM3e at "
            "4.8 TB/s); NVLink 4: 900 GB/s per GPU, 450 GB/s each way",
        ),
        _gpu(
            "l40-pcie",
            181,
            25,
            25,
            45,
            "NVIDIA L40 datasheet: 181 TFLOPS dense fp16 tensor with fp32 accumulate (362 with sparsity), 48 GB "
            "GDDR6 (45 GiB with ECC on); "
            "PCIe 4.0 x16: 32 GB/s "
            "each way, about 25 GB/s between two GPUs without NVLink",
        ),
        _gpu(
            "rtx4090-pcie",
            165,
            25,
            25,
            24,
            "NVIDIA Ada whitepaper: RTX 4090 165 TFLOPS dense fp16 tensor with fp32 accumulate (as PyTorch "
            "runs it; 330 with fp16 accumulate), 24 GB GDDR6X; PCIe 4.0 x16, no NVLink and no "
            "peer-to-peer: about 25 GB/s each way through the host",
        ),
    )
}


def hardware_profile(name: str) -> Hardware:
    try:
        return PROFILES[name]
    except KeyError:
        raise ParadiffError(f"unknown hardware {name!r}; use one of {', '.join(PROFILES)}") from None


def hardware_names() -> tuple[str, ...]:
    return tuple(PROFILES)
