"""Peak memory per rank of ``pipefusion`` when every rank loads the whole model and when each loads its stage only.

    python benchmarks/load_memory.py [--nproc 2] [--layers 28] [--out benchmarks/out/load_memory.json]

The pipeline is saved once to a temporary folder: PixArt-Sigma's transformer (its public config, random
weights, float32: 2.4 GB at 28 layers) with the tiny benchmark VAE and no text encoder. Each rank then loads
it — ``from_pretrained`` (the whole model), or ``paradiff.load_stage_pipeline`` (its stage of the blocks) —
parallelizes it with ``pipefusion`` and draws one 256 px image in 2 steps. Printed per rank: the transformer
bytes the rank held after loading, the peak resident memory while loading and parallelizing (safetensors are
memory-mapped: a weight is resident once read, and ``parallelize`` reads each one it holds), how much more that
is than before loading (the process's own torch and Python), and the peak while generating. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

STEPS, SIZE = 2, 256


def save_pipeline(folder: str, layers: int) -> None:
    from diffusers import PixArtTransformer2DModel

    from paradiff.plan.architectures import architecture
    from paradiff.tiny import build_pipeline

    pipe = build_pipeline("pixart", size="bench")
    config = {**architecture("pixart-sigma").spec["config"], "num_layers": layers}
    pipe.transformer = PixArtTransformer2DModel.from_config(config)
    pipe.register_modules(transformer=pipe.transformer)
    pipe.save_pretrained(folder)


def on_rank(folder: str, by_stage: bool) -> dict:
    import torch
    import torch.distributed as dist

    import paradiff
    from paradiff.memory import PeakMemory, _status_bytes
    from paradiff.tiny import prompt_inputs

    device = torch.device("cpu")
    before = _status_bytes("VmRSS")
    with PeakMemory(device) as loading:  # parallelize reads every weight it holds (the ranks compare checksums)
        pipe = load_stage_pipeline_or_whole(folder, by_stage)
        held = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters() if p.device.type != "meta")
        pipe = paradiff.parallelize(pipe, strategy="pipefusion", warmup_steps=STEPS)
    inputs = prompt_inputs(pipe, "pixart")
    with PeakMemory(device) as generating:
        pipe(**inputs, height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent")
    row = {
        "rank": dist.get_rank(),
        "by_stage": by_stage,
        "before_mb": before / 2**20,
        "loading_peak_mb": loading.bytes / 2**20,
        "generating_peak_mb": generating.bytes / 2**20,
        "transformer_held_mb": held / 2**20,
    }
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    paradiff.unparallelize(pipe)
    return rows


def load_stage_pipeline_or_whole(folder: str, by_stage: bool):
    import paradiff
    from paradiff.loading import load_pipeline

    return paradiff.load_stage_pipeline(folder, device="cpu") if by_stage else load_pipeline(folder)


def main() -> None:
    from paradiff.launch import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--out", default="benchmarks/out/load_memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        save_pipeline(folder, args.layers)
        for by_stage in (False, True):
            rows += run_on_ranks(on_rank, args.nproc, folder, by_stage, device="cpu")
    print(
        f"{'loading':16s} {'rank':>4s} {'transformer MB':>15s} {'load peak MB':>13s} {'(+ over start)':>15s} "
        f"{'generate peak MB':>17s}"
    )
    for row in rows:
        how = "its stage" if row["by_stage"] else "whole model"
        print(
            f"{how:16s} {row['rank']:4d} {row['transformer_held_mb']:15,.0f} {row['loading_peak_mb']:13,.0f} "
            f"{row['loading_peak_mb'] - row['before_mb']:+15,.0f} {row['generating_peak_mb']:17,.0f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
