"""``paradiff serve`` under a mix of requests: p50/p95 latency and images per minute, one device against 2 ranks
under each strategy and under ``auto`` (the setting picked per request shape), and what batching gains.

Each setting is a server of its own (``paradiff serve --nproc 1``, or ``--nproc 2 --strategy S``), one thread
per rank. Every request of the mix is sent once first (not timed: ``auto`` plans each shape then), then the
mix ``--repeat`` times in turn by one client; a request the server refuses (the CFG split cannot run a request
without guidance) counts as not served. Every request asks for the exact result (``warmup_steps`` = steps).
The batching table has 4 clients send one shape at once to a cfg server, with ``--max-batch`` 1 and 4.

    python benchmarks/serve_bench.py --out serve-bench.json
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import bench_common  # noqa: F401  (puts tests/ on sys.path)
import numpy as np
from serve_process import ServerProcess

PROMPT = "a large red circle at the top left on a white background"


def mix(sizes: list[int], guidance: list[float]) -> list[dict]:
    """One request per size × guidance: guided requests (the CFG split pays) and unguided ones (it cannot run)."""
    return [{"size": f"{size}x{size}", "guidance_scale": scale} for size in sizes for scale in guidance]


def _post(server: ServerProcess, body: dict) -> tuple[int, float, dict]:
    """The status, the client's seconds and the reply's ``paradiff`` object (its ``images``; empty if refused)."""
    start = time.perf_counter()
    reply = server.http.post("/v1/images/generations", json={"prompt": PROMPT, "seed": 0, **body})
    seconds = time.perf_counter() - start
    if reply.status_code != 200:
        return reply.status_code, seconds, {}
    return reply.status_code, seconds, {**reply.json()["paradiff"], "images": len(reply.json()["data"])}


def _figures(answers: list[tuple[int, float, dict]], wall_s: float) -> dict:
    served = [seconds for status, seconds, _ in answers if status == 200]
    images = sum(report.get("images", 0) for _, _, report in answers)
    batches = [report["batch"] for _, _, report in answers if report]
    return {
        "requests": len(answers),
        "served": len(served),
        "p50_s": float(np.percentile(served, 50)) if served else None,
        "p95_s": float(np.percentile(served, 95)) if served else None,
        "images_per_minute": 60 * images / wall_s,
        "wall_s": wall_s,
        "mean_batch": float(np.mean(batches)) if batches else None,
    }


def _server(args, nproc: int, strategy: str, *extra: str) -> ServerProcess:
    server = ServerProcess(
        *("--model", args.model, "--nproc", str(nproc), "--strategy", strategy, "--threads", "1"),
        *("--steps", str(args.steps), "--warmup", str(args.steps), "--max-queue", "64", "--request-timeout", "3600"),
        *extra,
    )
    server.wait_ready(900)
    return server


def run_setting(args, nproc: int, strategy: str, requests: list[dict]) -> dict:
    server = _server(args, nproc, strategy)
    try:
        planning = [_post(server, body) for body in requests]  # auto plans each shape here
        start = time.perf_counter()
        answers = [_post(server, body) for _ in range(args.repeat) for body in requests]
        figures = _figures(answers, time.perf_counter() - start)
        figures["first_of_each_shape_s"] = sum(seconds for _, seconds, _ in planning)
        figures["ran_under"] = {
            f"{body['size']} g{body['guidance_scale']:g}": report.get("strategy", f"refused ({status})")
            for body, (status, _, report) in zip(requests, answers, strict=False)
        }
        return figures
    finally:
        server.stop()


def run_batching(args, max_batch: int, clients: int = 4) -> dict:
    server = _server(args, 2, "cfg", "--max-batch", str(max_batch))
    body = {"size": f"{args.sizes[0]}x{args.sizes[0]}", "guidance_scale": 2.0}
    try:
        _post(server, body)
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda _: _post(server, body), range(clients * args.repeat * 2)))
        return _figures(answers, time.perf_counter() - start)
    finally:
        server.stop()


def _row(name: str, figures: dict, base: dict | None) -> str:
    p50 = "-" if figures["p50_s"] is None else f"{figures['p50_s']:.2f}"
    p95 = "-" if figures["p95_s"] is None else f"{figures['p95_s']:.2f}"
    gain = f"{figures['images_per_minute'] / base['images_per_minute']:.2f}×" if base else "1.00×"
    served = f"{figures['served']}/{figures['requests']}"
    return f"| {name} | {served} | {p50} | {p95} | {figures['images_per_minute']:.1f} | {gain} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="paradiff-tiny-dit")
    parser.add_argument("--sizes", default="256,384", help="comma list of request sizes (px)")
    parser.add_argument("--guidance", default="2,1", help="comma list of guidance scales in the mix")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="times the mix is sent, timed")
    parser.add_argument("--strategies", default="cfg,patch,ulysses,parastep,pipefusion", help="fixed strategies")
    parser.add_argument("--no-batching", action="store_true", help="skip the batching table")
    parser.add_argument("--out", default="serve-bench.json")
    args = parser.parse_args()
    args.sizes = [int(size) for size in args.sizes.split(",")]
    requests = mix(args.sizes, [float(scale) for scale in args.guidance.split(",")])
    settings = [("one device", 1, "auto"), *((f"2 ranks, {s}", 2, s) for s in args.strategies.split(","))]
    settings.append(("2 ranks, auto", 2, "auto"))
    results = {}
    for name, nproc, strategy in settings:
        results[name] = run_setting(args, nproc, strategy, requests)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    batching = {}
    if not args.no_batching:
        for max_batch in (1, 4):
            batching[max_batch] = run_batching(args, max_batch)
            print(f"--max-batch {max_batch}: {json.dumps(batching[max_batch])}", flush=True)
    base = results["one device"]
    mix_text = ", ".join(f"{body['size']} at guidance {body['guidance_scale']:g}" for body in requests)
    print(f"\nmix: {mix_text}; {args.steps} steps; {args.repeat} rounds, one client")
    print("| setting | served | p50 s | p95 s | images/min | vs one device |\n|---|---|---|---|---|---|")
    for name, figures in results.items():
        print(_row(name, figures, None if name == "one device" else base))
    picks = "; ".join(f"{shape}: {label}" for shape, label in results["2 ranks, auto"]["ran_under"].items())
    print(f"\nauto ran: {picks}")
    if batching:
        print(f"\nbatching: 4 clients at once, {args.sizes[0]} px guided, 2 ranks cfg")
        print("| --max-batch | served | p50 s | p95 s | images/min | vs 1 |\n|---|---|---|---|---|---|")
        for max_batch, figures in batching.items():
            print(_row(str(max_batch), figures, None if max_batch == 1 else batching[1]))
            print(f"  mean requests per call: {figures['mean_batch']:.2f}")
    with open(args.out, "w") as out:
        json.dump({"args": vars(args), "mix": requests, "settings": results, "batching": batching}, out, indent=2)


if __name__ == "__main__":
    main()
