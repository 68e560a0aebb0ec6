"""Every strategy at 2 ranks, exact mode (synchronous every step), against one device on the ranks' own device.

    PARADIFF_BACKEND=gloo python benchmarks/gpu_strategies.py --device cuda   # two ranks share one GPU
    PARADIFF_STAGE_HOST=1 python benchmarks/gpu_strategies.py --device cpu    # the host-staging path on CPU

Each rank builds the tiny pipeline of the strategy's family (random weights, the same on every rank), runs
it on one device, then parallelized, and compares the latents: the largest difference relative to the
output's largest magnitude, and whether every rank returned the same output. fp32 passes at 1e-5; ``ring``
needs an attention backend that returns the log-sum-exp (cuDNN, half precision), so it runs in bfloat16 and
passes at 2e-2, and it is refused on CPU. A refused strategy ran nothing: it is shown as refused, never counted
as a pass. Prints a table, writes JSON and exits 0 when every requested strategy ran exact, 1 when one ran and was
not exact, and 3 when none failed but not every requested strategy ran (a refusal: on CPU, pass ``--strategies``
without ``ring``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

#: strategy: (family, dtype); ``dualparal`` runs the tiny SkyReels diffusion-forcing video pipeline.
CASES = {
    "patch": ("sd", "float32"),
    "pipefusion": ("pixart", "float32"),
    "parastep": ("pixart", "float32"),
    "asyncdiff": ("sd", "float32"),
    "cfg": ("sd", "float32"),
    "ulysses": ("pixart", "float32"),
    "dualparal": ("skyreels-df", "float32"),
    "ring": ("pixart", "bfloat16"),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
STEPS = 3
#: Exit codes: every requested strategy ran exact; one ran and was not exact; none failed, but one did not run.
PASSED, FAILED, NOT_ALL_RAN = 0, 1, 3


def outcome(row: dict) -> str:
    """``"exact"``, ``"not exact"`` or ``"refused"``: a refused strategy ran nothing, so it is neither a pass nor a
    failure of exactness, and the table and the exit code keep it apart from both."""
    if "refused" in row:
        return "refused"
    return "exact" if row["exact"] else "not exact"


def exit_code(rows: list[dict], names: list[str]) -> int:
    """:data:`FAILED` if a case ran and was not exact, else :data:`NOT_ALL_RAN` if a requested strategy was refused
    (or returned no row), else :data:`PASSED`."""
    outcomes = {row["strategy"]: outcome(row) for row in rows}
    if "not exact" in outcomes.values():
        return FAILED
    if any(outcomes.get(name) != "exact" for name in names):
        return NOT_ALL_RAN
    return PASSED


def row_line(row: dict) -> str:
    """One line of the table: the strategy, what it ran on and its outcome."""
    if "refused" in row:
        return f"{row['strategy']:10s} {row['family']:12s} REFUSED (did not run): {row['refused']}"
    return (
        f"{row['strategy']:10s} {row['family']:12s} {row['dtype']:9s} {row['device']:7s} "
        f"{row['relative_difference']:.2e} of the largest magnitude, ranks equal: {row['ranks_equal']}: "
        f"{'exact' if row['exact'] else 'NOT EXACT'}"
    )


def summary(rows: list[dict], names: list[str]) -> str:
    """How many requested strategies passed, failed and were refused (a refusal is not a pass)."""
    outcomes = [outcome(row) for row in rows]
    missing = sorted(set(names) - {row["strategy"] for row in rows})
    line = (
        f"{outcomes.count('exact')} of {len(names)} exact, {outcomes.count('not exact')} not exact, "
        f"{outcomes.count('refused')} refused"
    )
    return line + (f", no result for {', '.join(missing)}" if missing else "")


def _image_case(pipe, family: str, device, strategy: str):
    import torch

    import paradiff
    from paradiff.tiny import prompt_inputs

    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt_inputs(pipe, family).items()}

    def call():
        generator = torch.Generator().manual_seed(0)
        return pipe(**inputs, height=64, width=64, num_inference_steps=STEPS, generator=generator, output_type="latent")

    reference = call().images
    pipe = paradiff.parallelize(pipe, strategy=strategy, **({} if strategy == "cfg" else {"warmup_steps": STEPS}))
    try:
        return reference, call().images
    finally:
        paradiff.unparallelize(pipe)


def _video_case(device):
    import paradiff
    from paradiff.strategies.dualparal import one_device_schedule
    from paradiff.tiny import pipeline
    from paradiff.tiny.forcing import df_call

    pipe = pipeline("skyreels-df").to(device)
    with one_device_schedule(pipe, None):
        reference = pipe(**df_call()).frames
    pipe = paradiff.parallelize(pipe, strategy="dualparal", dualparal_displaced=False)
    try:
        return reference, pipe(**df_call()).frames
    finally:
        paradiff.unparallelize(pipe)


def on_rank(device_name: str, names: list[str]) -> list[dict]:
    import torch
    import torch.distributed as dist

    from paradiff.devices import rank_device
    from paradiff.errors import ParadiffError
    from paradiff.tiny import build_pipeline

    device = rank_device(device_name)
    rows = []
    for name in names:
        family, dtype = CASES[name]
        row = {"strategy": name, "family": family, "dtype": dtype, "device": str(device)}
        try:
            if name == "dualparal":
                reference, output = _video_case(device)
            else:
                pipe = build_pipeline(family).to(device, getattr(torch, dtype))
                if name == "ring" and device.type == "cuda":
                    pipe.transformer.set_attention_backend("_native_cudnn")
                reference, output = _image_case(pipe, family, device, name)
        except ParadiffError as error:
            rows.append({**row, "refused": str(error)})
            continue
        reference, output = reference.float().cpu(), output.float().cpu()
        digest = hashlib.sha256(output.numpy().tobytes()).hexdigest()
        digests: list = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        relative = float((output - reference).abs().max() / reference.abs().max())
        exact = relative <= TOLERANCE[dtype] and len(set(digests)) == 1
        rows.append({**row, "relative_difference": relative, "ranks_equal": len(set(digests)) == 1, "exact": exact})
    return rows


def main() -> int:
    from paradiff.launch import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--strategies", default=",".join(CASES), help="comma list (default: all)")
    parser.add_argument("--out", default="benchmarks/out/gpu_strategies.json")
    args = parser.parse_args()
    names = [name for name in args.strategies.split(",") if name]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"no case for {', '.join(unknown)}; choose from {', '.join(CASES)}")
    ran = run_on_ranks(on_rank, 2, args.device, names, device=args.device)
    rows = [{**row, "outcome": outcome(row)} for row in ran]
    for row in rows:
        print(row_line(row))
    print(summary(rows, names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return exit_code(rows, names)


if __name__ == "__main__":
    sys.exit(main())
