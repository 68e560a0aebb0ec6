"""Per-band compute time of real-sized denoisers with random weights: the whole call against one 1/N band.

    python benchmarks/gpu_bands.py                       # on a GPU: the cases below, about 3 minutes on an H200
    python benchmarks/gpu_bands.py --device cpu --cases pixart-sigma@64 --bands 1,2   # a dry run on the CPU

What a displaced patch strategy gains on N GPUs rests on how fast one GPU runs 1/N of the rows: a small
band runs at a lower rate (launch-bound kernels, smaller matrix products). For each case (an architecture
of ``paradiff/plan/architectures``, its size, frames and dtype) this builds the denoiser from its public
config with random weights on the device, calls it on random inputs shaped as its pipeline's (the whole
latent, then 1/N of its rows), and prints the time, the achieved TFLOP/s, and what the cost model
predicts for the same call with ``--hardware`` (its datasheet profile): the figures that calibrate the
profile. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from paradiff.plan.architectures import architecture
from paradiff.plan.costs import one_device_step
from paradiff.plan.hardware import hardware_profile
from paradiff.plan.workload import meta_model, trace

#: architecture@size[x frames]:dtype
CASES = (
    "sdxl@1024:float16",
    "sdxl@2048:float16",
    "sdxl@3840:float16",
    "flux-dev@1024:bfloat16",
    "wan2.1-14b@480x33:bfloat16",
)


def parse_case(case: str) -> tuple[str, int, int | None, str | None]:
    name, _, rest = case.partition("@")
    rest, _, dtype = rest.partition(":")
    size, _, frames = rest.partition("x")
    return name, int(size), int(frames) if frames else None, dtype or None


def real_inputs(meta_inputs, device: torch.device, dtype: torch.dtype):
    """Random tensors in ``dtype`` (integers: zeros) of the meta inputs' shapes, on ``device``."""
    if isinstance(meta_inputs, dict):
        return {key: real_inputs(value, device, dtype) for key, value in meta_inputs.items()}
    if isinstance(meta_inputs, torch.Tensor):
        if meta_inputs.is_floating_point():
            return torch.randn(meta_inputs.shape, dtype=dtype, device=device)
        return torch.zeros(meta_inputs.shape, dtype=meta_inputs.dtype, device=device)
    return meta_inputs


def timed(call, device: torch.device, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def run_case(case: str, bands: list[int], device: torch.device, hardware: str, repeats: int) -> list[dict]:
    name, size, frames, dtype_name = parse_case(case)
    arch = architecture(name)
    dtype = getattr(torch, dtype_name) if dtype_name else arch.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = arch.model_class().from_config(arch.spec["config"]).eval()
    finally:
        torch.set_default_dtype(previous)
    profile = hardware_profile(hardware)
    meta = meta_model(arch.model_class(), arch.spec["config"], dtype)
    rows = []
    for band in bands:
        dims = arch.dims(size, frames)
        rows_per_band = dims["H"] // band // 2 * 2
        dims = {**dims, "H": rows_per_band}
        meta_inputs = arch.inputs(dims)
        workload = trace(meta, (), meta_inputs, arch.token_rows(dims))  # one call, as timed below
        inputs = real_inputs(meta_inputs, device, dtype)
        with torch.no_grad():
            seconds = timed(lambda inputs=inputs, model=model: model(**inputs), device, repeats)
        predicted = one_device_step(workload, profile, str(dtype).removeprefix("torch."))
        rows.append(
            {
                "case": case,
                "band": f"1/{band}",
                "latent_rows": rows_per_band,
                "ms": seconds * 1e3,
                "tflops": workload.flops / seconds / 1e12,
                "kernels": workload.kernels,
                f"predicted_ms_{hardware}": predicted * 1e3,
            }
        )
        print(
            f"{case:28s} {rows[-1]['band']:>4s} {seconds * 1e3:9.1f} ms {rows[-1]['tflops']:7.1f} TFLOP/s "
            f"(predicted {predicted * 1e3:9.1f} ms on {hardware})",
            flush=True,
        )
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of architecture@size[xframes][:dtype]")
    parser.add_argument("--bands", default="1,2,4,8", help="comma list of N: time one 1/N band of the rows")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hardware", default="h200-nvlink", help="the profile to set the predictions beside")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out/gpu_bands.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    bands = [int(item) for item in args.bands.split(",")]
    rows = []
    for case in args.cases.split(","):
        rows += run_case(case, bands, device, args.hardware, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
