"""What the ranks' agreement costs: once at ``parallelize`` (the pipeline's description, weight checksums
included) and at every ``pipe(...)`` call (every argument described, a 16-byte digest all-gathered).

    python benchmarks/agreement_bench.py [--repeats 50]

Two gloo ranks on this machine, one thread each. Per model: the parameters, the seconds ``describe_setup``
takes (one pass over the weights), and per call the milliseconds of describing the arguments and of the
whole agreement (describe + exchange), median over ``--repeats``; beside them one ``pipe(...)`` call at the
CLI's size for scale. A last row times the checksum alone on a 100M-parameter float32 module (GB/s).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import bench_common  # noqa: F401  (puts tests/ on the import path)
import torch
from rank_workers import RankPool

#: The built-in model and the benchmark-sized random ones.
MODELS = ("paradiff-tiny", "random-sd", "random-pixart")


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(model: str, repeats: int, size: int, steps: int) -> dict:
    import paradiff
    from paradiff.loading import load_pipeline, prompt_kwargs
    from paradiff.runtime.consensus import agree, describe_call, describe_setup

    pipe = load_pipeline(model)
    inputs = prompt_kwargs(pipe, model, "a red circle at the top left")
    params = sum(p.numel() for m in pipe.components.values() if isinstance(m, torch.nn.Module) for p in m.parameters())
    start = time.perf_counter()
    describe_setup(pipe, paradiff.ParallelConfig().as_options())
    setup_s = time.perf_counter() - start
    pipe = paradiff.parallelize(pipe, warmup_steps=4)
    state = pipe._paradiff
    signature = inspect.signature(state.original_class.__call__)
    call = {**inputs, "height": size, "width": size, "num_inference_steps": steps, "output_type": "np"}
    call["generator"] = torch.Generator().manual_seed(0)
    describe_ms = _median_ms(lambda: describe_call(signature, pipe, (), call), repeats)
    agree_ms = _median_ms(
        lambda: agree(describe_call(signature, pipe, (), call), state.world, "the call", "same call"), repeats
    )
    start = time.perf_counter()
    pipe(**call)
    call_s = time.perf_counter() - start
    paradiff.unparallelize(pipe)
    return {
        "model": model,
        "parameters": params,
        "setup_s": setup_s,
        "describe_ms": describe_ms,
        "agree_ms": agree_ms,
        "call_s": call_s,
        "share": agree_ms / 1e3 / call_s,
    }


def checksum_throughput() -> float:
    """GB/s of ``weights_checksum`` over a 100M-parameter float32 module on this CPU, one thread."""
    from paradiff.runtime.consensus import weights_checksum

    torch.set_num_threads(1)
    module = torch.nn.Sequential(*[torch.nn.Linear(2500, 4000) for _ in range(10)])
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    weights_checksum(module)
    start = time.perf_counter()
    weights_checksum(module)
    return nbytes / 1e9 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/out/agreement_bench.json")
    args = parser.parse_args()
    with RankPool(2, timeout_s=1800, threads_per_rank=1) as pool:
        rows = [pool.run(measure, model, args.repeats, args.size, args.steps)[0] for model in MODELS]
    gbps = checksum_throughput()
    print(f"2 gloo ranks, 1 thread each; a call: median of {args.repeats} at {args.size} px, {args.steps} steps")
    columns = ("parameters", 12), ("setup s", 8), ("describe ms", 12), ("agree ms", 9), ("call s", 7), ("share", 7)
    print(f"{'model':<15} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for r in rows:
        print(
            f"{r['model']:<15} {r['parameters']:>12,} {r['setup_s']:>8.3f} {r['describe_ms']:>12.2f} "
            f"{r['agree_ms']:>9.2f} {r['call_s']:>7.2f} {100 * r['share']:>6.2f}%"
        )
    print(f"weights checksum alone: {gbps:.2f} GB/s (100M float32 parameters, 1 thread)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "checksum_gb_per_s": gbps}, indent=2))


if __name__ == "__main__":
    main()
