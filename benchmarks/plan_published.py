"""The cost model against published multi-GPU speedups it was not fitted to (no GPU needed).

    python benchmarks/plan_published.py

Each case is a published measurement of a parallel system on a GPU server: the model (its public config,
traced on the meta device), the size, the steps, the strategy as that system ran it, and the speedup over
one GPU. The prediction is :func:`paradiff.plan.costs.predict` with the server's hardware profile. A
published time that includes the VAE decode as the stock pipeline runs it (whole, on one rank) is
predicted with it: DistriFusion's benchmark (``scripts/run_sdxl.py``) decodes to PIL and parallelizes only
the U-Net; SDXL's pipeline decodes in float32 (``force_upcast``). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradiff.plan.architectures import architecture
from paradiff.plan.costs import decode_fixed, predict
from paradiff.plan.hardware import hardware_profile
from paradiff.plan.workload import meta_model, trace

DISTRIFUSION = "DistriFusion (CVPR 2024), SDXL, 50-step DDIM, A100 NVLink: README and paper figure"
XDIT_HUNYUAN = "xDiT docs/performance/hunyuanvideo.md, HunyuanVideo 960×960, 129 frames, 50 steps, H100, Ulysses"
XDIT_FLUX = "xDiT docs/performance/flux.md, FLUX.1-dev 1024 px, 28 steps, 4×H100, PyTorch eager"
XDIT_FLUX_COMPILED = "xDiT docs/performance/flux.md, FLUX.1-dev 1024 px, 28 steps, 4×H100, torch.compile"
#: xDiT's FLUX.1-dev table: seconds on 1 GPU, then (strategy, ranks, seconds), eager and compiled.
XDIT_FLUX_TABLE = {
    XDIT_FLUX: (6.71, (("ulysses", 2, 4.38), ("ring", 2, 5.31), ("ulysses", 4, 4.24), ("ring", 4, 5.11))),
    XDIT_FLUX_COMPILED: (4.30, (("ulysses", 2, 2.68), ("ring", 2, 2.60), ("ulysses", 4, 1.63), ("ring", 4, 1.98))),
}
#: Sources whose published times include the stock VAE decode on one rank.
DECODE_TIMED = (DISTRIFUSION,)
#: (source, architecture, size, frames, steps, hardware, strategy, ranks, cfg_parallel, published speedup)
CASES = [
    *[
        (DISTRIFUSION, "sdxl", size, None, 50, "a100-nvlink", strategy, n, n > 2, published)
        for size, speedups in ((1024, (1.5, 2.2, 2.8)), (3840, (1.8, 3.4, 6.1)))
        for (n, strategy), published in zip(((2, "cfg"), (4, "patch"), (8, "patch")), speedups, strict=True)
    ],
    *[
        (XDIT_HUNYUAN, "hunyuanvideo", 960, 129, 50, "h100-nvlink", "ulysses", n, False, 1735.01 / seconds)
        for n, seconds in ((2, 934.09), (3, 645.45), (6, 367.02))
    ],
    *[
        (source, "flux-dev", 1024, None, 28, "h100-nvlink", strategy, n, False, one_gpu / seconds)
        for source, (one_gpu, runs) in XDIT_FLUX_TABLE.items()
        for strategy, n, seconds in runs
    ],
]


def run() -> list[dict]:
    workloads, rows = {}, []
    for source, name, size, frames, steps, hardware, strategy, n, cfg_parallel, published in CASES:
        arch = architecture(name)
        dims = arch.dims(size, frames)
        if (name, size, frames) not in workloads:
            model = meta_model(arch.model_class(), arch.spec["config"], arch.dtype)
            decode = arch.decode_cost(dims) if source in DECODE_TIMED else None
            workloads[name, size, frames] = (
                trace(model, (), arch.inputs(dims), arch.token_rows(dims), arch.calls_per_step),
                decode,
            )
        workload, decode = workloads[name, size, frames]
        profile = hardware_profile(hardware)
        fixed = decode_fixed(decode, profile, banded=False)
        prediction = predict(workload, profile, arch.spec["dtype"], strategy, n, steps, 4, cfg_parallel, fixed)
        rows.append(
            {
                "source": source,
                "model": name,
                "size": size,
                "frames": frames,
                "hardware": hardware,
                "setting": f"{strategy}{' + cfg_parallel' if prediction.cfg_parallel else ''} on {n}"
                + (" (compiled)" if "torch.compile" in source else ""),
                "published_speedup": round(published, 2),
                "predicted_speedup": round(prediction.predicted_speedup, 2),
                "error": prediction.predicted_speedup / published - 1,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/out/plan_published.json")
    args = parser.parse_args()
    rows = run()
    print(
        f"{'model':13s} {'size':>5s} {'hardware':12s} {'setting':26s} {'published':>9s} {'predicted':>9s} {'error':>6s}"
    )
    for r in rows:
        print(
            f"{r['model']:13s} {r['size']:5d} {r['hardware']:12s} {r['setting']:26s} {r['published_speedup']:8.2f}× "
            f"{r['predicted_speedup']:8.2f}× {r['error']:+6.0%}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
