"""The ``paradiff bench`` report: one row per run, written as results.json, report.md and report.html.

Latency is the median over prompts, speedup the ratio of median latencies, fidelity the mean over
prompts of each metric against the one-device image with the same seed.
"""

from __future__ import annotations

import html
import json
import math
import os
import platform
import statistics
from datetime import datetime
from pathlib import Path

import torch

from .fidelity import fidelity, lpips_unavailable_reason
from .figures import DIFF_GAIN, comparison_grid, save_png, speedup_psnr_plot
from .job import BenchJob
from .run import BenchResults, RunResult

PLOT_FILE = "speedup-vs-psnr.png"
PSNR_NULL_NOTE = "psnr_db null: identical to the one-device image for at least one prompt (PSNR is infinite)"
TABLE_HEADERS = ("run", "latency s", "speedup", "MB/step/rank", "comm wait s", "PSNR dB", "SSIM", "LPIPS")


def write_report(job: BenchJob, results: BenchResults) -> list[str]:
    """Write every report file into ``job.out``; returns the lines to print."""
    out = Path(job.out)
    skipped = lpips_unavailable_reason()
    baseline = results.runs[0]
    rows = [_row(job, results.prompts, run, baseline, with_lpips=skipped is None) for run in results.runs]
    for row, run in zip(rows, results.runs, strict=True):
        if row["grid"]:
            save_png(comparison_grid(run.images, baseline.images), out / row["grid"])
    speedup_psnr_plot([(row["run"], row["speedup"], row["psnr_db"]) for row in rows[1:]], out / PLOT_FILE)
    lpips_status = "ok" if skipped is None else f"skipped: {skipped}"
    config = _config(job, results)
    document = {"config": config, "rows": rows, "lpips": lpips_status}
    (out / "results.json").write_text(json.dumps(_json_safe(document), indent=2, allow_nan=False) + "\n")
    table = _markdown_table(rows)
    (out / "report.md").write_text(_markdown(config, rows, table, lpips_status))
    (out / "report.html").write_text(_html(config, rows, lpips_status))
    lines = [table]
    if skipped is not None:
        lines.append(f"LPIPS skipped: {skipped}")
    lines.append(f"wrote {out / 'report.html'}, report.md, results.json and the images into {out}")
    return lines


def _row(job: BenchJob, prompts: list[str], run: RunResult, baseline: RunResult, with_lpips: bool) -> dict:
    scores = fidelity(run.images, baseline.images, with_lpips)
    per_prompt = [
        {
            "prompt": prompt,
            "seed": job.seed + index,
            "latency_s": run.latency_s[index],
            "bytes_per_step": run.bytes_per_step[index],
            "wait_s": run.wait_s[index],
            **scores[index],
        }
        for index, prompt in enumerate(prompts)
    ]
    latency = statistics.median(run.latency_s)
    spec = run.spec
    return {
        "run": spec.label,
        "strategy": spec.strategy,
        "warmup": spec.warmup,
        "latency_s": latency,
        "speedup": statistics.median(baseline.latency_s) / latency,
        "bytes_per_step": statistics.median(run.bytes_per_step),
        "wait_s": statistics.median(run.wait_s),
        "psnr_db": statistics.fmean(score["psnr_db"] for score in scores),
        "ssim": statistics.fmean(score["ssim"] for score in scores),
        "lpips": statistics.fmean(score["lpips"] for score in scores) if with_lpips else None,
        "grid": None if spec.strategy is None else f"grid-{spec.label.replace(' ', '-').replace('=', '')}.png",
        "per_prompt": per_prompt,
    }


def _config(job: BenchJob, results: BenchResults) -> dict:
    return {
        "command": job.command(),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": job.model,
        "strategies": list(job.strategies),
        "warmups": list(job.warmups),
        "nproc": results.world_size,
        "threads_per_rank": job.threads,
        "steps": job.steps,
        "size": results.runs[0].images[0].shape[0],  # the model's own when --size was not given
        "seed": job.seed,
        "prompts": results.prompts,
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "device": results.device,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "notes": [
            "latency_s: median over prompts of one image's wall time on rank 0 (VAE decode included)",
            "speedup: one-device median latency / this run's median latency",
            "bytes_per_step, wait_s: rank 0's bytes sent per denoising step and time blocked on communication "
            "per image (paradiff.comm_stats), median over prompts; 0 for one device",
            "psnr_db, ssim, lpips: mean over prompts against the one-device image with the same seed",
            PSNR_NULL_NOTE,
        ],
    }


def _json_safe(value):
    """``value`` with every non-finite float replaced by None (JSON has no inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _cells(row: dict) -> list[str]:
    psnr = row["psnr_db"]
    return [
        row["run"],
        f"{row['latency_s']:.2f}",
        f"{row['speedup']:.2f}×",
        f"{row['bytes_per_step'] / 1e6:.2f}",
        f"{row['wait_s']:.2f}",
        f"{psnr:.1f}" if math.isfinite(psnr) else "∞",
        f"{row['ssim']:.4f}",
        "—" if row["lpips"] is None else f"{row['lpips']:.4f}",
    ]


def _markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADERS) + " |", "|---" * len(TABLE_HEADERS) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def _settings(config: dict) -> list[tuple[str, str]]:
    machine = config["machine"]
    return [
        ("command", config["command"]),
        ("date", config["date"]),
        ("model", config["model"]),
        ("size", f"{config['size']}×{config['size']} px"),
        ("steps", str(config["steps"])),
        (
            "ranks",
            f"{config['nproc']} ({config['threads_per_rank']} torch thread(s) per rank, and for the one-device run)",
        ),
        ("machine", f"{machine['cpu_count']} CPUs, {machine['platform']}, Python {machine['python']}"),
        ("torch", machine["torch"]),
        ("device", machine["device"]),
    ]


def _markdown(config: dict, rows: list[dict], table: str, lpips_status: str) -> str:
    lines = [f"# paradiff bench: {config['model']}", ""]
    lines += [
        f"- **{name}**: `{value}`" if name == "command" else f"- **{name}**: {value}"
        for name, value in _settings(config)
    ]
    lines += ["", table, "", f"LPIPS: {lpips_status}", ""]
    lines += [f"- {note}" for note in config["notes"]]
    lines += ["", f"![speedup vs PSNR]({PLOT_FILE})", ""]
    for row in rows:
        if row["grid"]:
            lines += [f"## {row['run']}", "", _grid_caption(), "", f"![{row['run']}]({row['grid']})", ""]
    lines += ["## Prompts", ""]
    lines += [
        f"{index + 1}. {prompt} (seed {config['seed'] + index})" for index, prompt in enumerate(config["prompts"])
    ]
    return "\n".join(lines) + "\n"


def _grid_caption() -> str:
    return (
        f"One row per prompt: one device | parallel | |difference| × {DIFF_GAIN:g} (inferno colour map, clipped at 1)."
    )


CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
dl.settings { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dl.settings dt { font-weight: bold; } dl.settings dd { margin: 0; }
code { background: #f5f5f5; padding: 0.1em 0.3em; word-break: break-all; }
img { max-width: 100%; image-rendering: pixelated; } .notes { color: #555; font-size: 0.9em; }
"""


def _html(config: dict, rows: list[dict], lpips_status: str) -> str:
    esc = html.escape
    settings = "".join(
        f"<dt>{esc(name)}</dt><dd>{f'<code>{esc(value)}</code>' if name == 'command' else esc(value)}</dd>"
        for name, value in _settings(config)
    )
    header = "".join(f"<th>{esc(name)}</th>" for name in TABLE_HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in _cells(row)) + "</tr>" for row in rows)
    notes = "".join(f"<li>{esc(note)}</li>" for note in [f"LPIPS: {lpips_status}", *config["notes"]])
    grids = "".join(
        f'<h2>{esc(row["run"])}</h2><p>{esc(_grid_caption())}</p><img src="{esc(row["grid"])}" alt="{esc(row["run"])}">'
        for row in rows
        if row["grid"]
    )
    prompts = "".join(
        f"<li>{esc(prompt)} (seed {config['seed'] + index})</li>" for index, prompt in enumerate(config["prompts"])
    )
    title = f"paradiff bench: {config['model']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title><style>{CSS}</style></head>
<body>
<h1>{esc(title)}</h1>
<dl class="settings">{settings}</dl>
<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>
<ul class="notes">{notes}</ul>
<h2>Speedup vs fidelity</h2><img src="{PLOT_FILE}" alt="speedup vs PSNR">
{grids}
<h2>Prompts</h2><ol>{prompts}</ol>
</body></html>
"""
