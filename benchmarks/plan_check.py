"""``paradiff plan``'s predictions against ``paradiff bench``'s measurements, run right after it (CPU ranks).

    python benchmarks/plan_check.py --models random-sd,random-pixart --size 512 --steps 20 --nproc 2 --warmup 4

For each model: ``paradiff plan --json`` (it times the model on this machine's ranks), then ``paradiff
bench`` on the strategies the plan predicted, one prompt, the same size, steps and warm-up. Prints the
predicted and measured speedups and bytes per step side by side, and writes JSON. Run it on a quiet
machine: another busy process skews a 2-rank ratio badly.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUT = Path("benchmarks/out")


def paradiff(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "paradiff.cli", *argv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"paradiff {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def check(model: str, size: int, steps: int, nproc: int, warmup: int) -> list[dict]:
    common = ["--model", model, "--size", str(size), "--steps", str(steps), "--nproc", str(nproc)]
    # bench runs each strategy with its default options: the rows predicted with others (a stride) are left out
    predicted = [
        row
        for row in json.loads(paradiff("plan", *common, "--warmup", str(warmup), "--json"))["predictions"]
        if not row["options"]
    ]
    strategies = ",".join(dict.fromkeys(row["strategy"] for row in predicted))
    folder = OUT / "plan_check" / model
    paradiff(
        "bench", *common, "--strategies", strategies, "--warmup", str(warmup), "--prompts", "1", "--out", str(folder)
    )
    measured = json.loads((folder / "results.json").read_text())["rows"]
    rows = []
    for row in predicted:
        run = next(r for r in measured if r.get("strategy") == row["strategy"])
        rows.append(
            {
                "model": model,
                "strategy": row["strategy"],
                "warmup_steps": warmup,
                "predicted_speedup": row["predicted_speedup"],
                "measured_speedup": run["speedup"],
                "error": row["predicted_speedup"] / run["speedup"] - 1,
                "predicted_bytes_per_step": row["bytes_per_step"],
                "measured_bytes_per_step": run["bytes_per_step"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="random-sd,random-pixart")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", default=str(OUT / "plan_check.json"))
    args = parser.parse_args()
    rows = [
        row for model in args.models.split(",") for row in check(model, args.size, args.steps, args.nproc, args.warmup)
    ]
    widths = (-14, -10, 9, 9, 7, 17, 8)
    header = ("model", "strategy", "predicted", "measured", "error", "MB/step predicted", "measured")
    cells = zip(header, widths, strict=True)
    print(" ".join(f"{name:{'<' if width < 0 else '>'}{abs(width)}s}" for name, width in cells))
    for r in rows:
        predicted_mb, measured_mb = r["predicted_bytes_per_step"] / 2**20, r["measured_bytes_per_step"] / 2**20
        print(
            f"{r['model']:14s} {r['strategy']:10s} {r['predicted_speedup']:8.2f}× {r['measured_speedup']:8.2f}× "
            f"{r['error']:+7.0%} {predicted_mb:17.2f} {measured_mb:8.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
