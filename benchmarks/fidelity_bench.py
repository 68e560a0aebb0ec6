"""Fidelity against speed on the built-in DiT: fixed warm-ups against the staleness guard's floors.

    python benchmarks/fidelity_bench.py                      # 2 ranks: every displaced strategy, warm-ups, floors
    python benchmarks/fidelity_bench.py --nproc 4 --strategies patch,pipefusion,parastep
    python benchmarks/fidelity_bench.py --drift-only         # what the guard watches, one device
    python benchmarks/fidelity_bench.py --held-out --warmup 1 # the follow measure's 24 held-out prompts

First, on one device, how far each thing a guard could watch moves from one step to the next, in dB of its
own size (20·log10(|x| / |x − x_prev|), smaller is further): the denoiser's input latent, the first block's
input, a middle block's self-attention keys, and the prediction. Then ``paradiff bench`` on N ranks (one
thread each) with every strategy × ``--warmup`` and × ``--floors``, on the built-in scenes: speedup, PSNR,
SSIM and LPIPS (where its weights are on this machine) against one device, and the steps each guarded run
refreshed (a floor's calibration runs once per size and is not in its time), the worst prompt's PSNR, and how
many prompts fell under their run's floor. The calibration runs on the first prompt: ``--held-out`` draws the
follow measure's held-out prompts (``paradiff.builtin.scenes.HELD_OUT_PROMPTS``, each with its own seed), so the
others show whether the floor holds on prompts it was not calibrated on. Prints both tables; writes JSON (and the
bench's own report under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import bench_common  # noqa: F401  (puts tests/ on sys.path)
import torch
from rank_workers import RankPool

from paradiff.bench.job import BenchJob
from paradiff.bench.report import write_report_files
from paradiff.bench.run import bench_on_rank
from paradiff.builtin import call_kwargs
from paradiff.builtin.scenes import HELD_OUT_PROMPTS
from paradiff.loading import default_size, load_pipeline

MODEL = "paradiff-tiny-dit"
PROMPT = "a large red circle at the top left on a white background"
#: How many built-in scenes the runs draw, unless ``--prompts`` or ``--held-out`` says otherwise.
SCENES = 4


def moved_db(latest: torch.Tensor, previous: torch.Tensor) -> float:
    return -20 * math.log10(float((latest - previous).norm() / latest.norm()))


def drift(steps: int, size: int) -> list[dict]:
    """Per step on one device: how far the latent, the first block's input, a middle block's keys and the
    prediction moved since the step before."""
    torch.set_num_threads(1)
    pipe = load_pipeline(MODEL)
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer
    seen = {"latent": [], "first block input": [], "middle keys": [], "prediction": []}

    def keep(name: str, tensor: torch.Tensor) -> None:
        seen[name].append(tensor.detach().clone())

    blocks = model.transformer_blocks
    handles = [
        model.register_forward_pre_hook(
            lambda _, args, kwargs: keep("latent", args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        ),
        blocks[0].register_forward_pre_hook(lambda _, args: keep("first block input", args[0])),
        blocks[len(blocks) // 2].attn1.to_k.register_forward_hook(lambda _, args, out: keep("middle keys", out)),
        model.register_forward_hook(lambda _, args, out: keep("prediction", out[0])),
    ]
    try:
        pipe(
            **call_kwargs("pixart", PROMPT, warn=False),
            height=size,
            width=size,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    finally:
        for handle in handles:
            handle.remove()
    return [
        {"step": step, **{name: moved_db(values[step], values[step - 1]) for name, values in seen.items()}}
        for step in range(1, steps)
    ]


def under_floor(row: dict) -> str:
    """How many of a bench row's prompts are under its floor ("" without one)."""
    floor = row["fidelity_floor_db"]
    scores = [prompt["psnr_db"] for prompt in row["per_prompt"]]
    return "" if floor is None else f"{sum(score < floor for score in scores)} of {len(scores)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", default="patch,pipefusion,parastep,asyncdiff")
    parser.add_argument("--warmup", default="1,2,4")
    parser.add_argument("--floors", default="30,40")
    parser.add_argument("--prompts", type=int, help=f"how many built-in scenes (default: {SCENES})")
    parser.add_argument(
        "--held-out", action="store_true", help=f"the {len(HELD_OUT_PROMPTS)} held-out prompts instead of the scenes"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=None, help="default: the model's own")
    parser.add_argument("--drift-only", action="store_true")
    parser.add_argument("--out", default="benchmarks/out/fidelity_bench")
    args = parser.parse_args()
    if args.held_out and args.prompts is not None:
        parser.error(f"--held-out draws the {len(HELD_OUT_PROMPTS)} held-out prompts; leave out --prompts")
    if args.prompts is None:
        args.prompts = len(HELD_OUT_PROMPTS) if args.held_out else SCENES
    size = args.size or default_size(MODEL)

    rows = drift(args.steps, size)
    names = [name for name in rows[0] if name != "step"]
    print(f"how far each moved since the step before, dB ({MODEL}, {size} px, {args.steps} steps, one device)")
    print("| step | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for row in rows:
        print(f"| {row['step']} | " + " | ".join(f"{row[name]:.1f}" for name in names) + " |")
    result = {"drift": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.drift_only:
        job = BenchJob(
            model=MODEL,
            strategies=tuple(args.strategies.split(",")),
            warmups=tuple(int(w) for w in args.warmup.split(",")),
            nproc=args.nproc,
            prompts=args.prompts,
            prompt_texts=HELD_OUT_PROMPTS if args.held_out else (),
            steps=args.steps,
            size=size,
            seed=0,
            threads=1,
            out=str(out / f"{args.nproc}-ranks"),
            floors=tuple(float(f) for f in args.floors.split(",") if f),
        )
        Path(job.out).mkdir(parents=True, exist_ok=True)
        with RankPool(args.nproc, timeout_s=7200, threads_per_rank=1) as pool:
            results = pool.run(bench_on_rank, job)[0]
        written = write_report_files(job, results)
        keys = ("run", "speedup", "psnr_db", "psnr_db_worst", "under_floor", "ssim", "lpips", "refreshed")
        print(f"\n{args.nproc} ranks, {args.prompts} prompts, {args.steps} steps, {size} px")
        print("| " + " | ".join(keys) + " |\n|---|" + "---|" * (len(keys) - 1))
        for row in written.document["rows"]:
            row["under_floor"] = under_floor(row)
            cells = [row[key] for key in keys]
            print("| " + " | ".join(c if isinstance(c, str) else "" if c is None else f"{c:.3g}" for c in cells) + " |")
        result["bench"] = {
            "command": job.command(),
            "rows": written.document["rows"],
            "lpips": written.document["lpips"],
        }
    (out / "fidelity_bench.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out / 'fidelity_bench.json'}")


if __name__ == "__main__":
    main()
