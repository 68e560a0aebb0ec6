"""The ``paradiff bench`` report: one row per run, written as results.json, report.md and report.html.

Latency is the median over prompts, speedup the ratio of median latencies, fidelity the mean over
prompts of each metric against the one-device output with the same seed. A video pipeline's report
scores every frame (mean and worst frame), sets each run's flicker beside the one-device video's,
and shows frame strips (report.md) and animated side-by-side previews (report.html).
"""

from __future__ import annotations

import html
import json
import math
import os
import platform
import re
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from .fidelity import fidelity, lpips_unavailable_reason, video_fidelity
from .figures import (
    DIFF_GAIN,
    DIFF_LABEL,
    STRIP_FRAMES,
    STRIP_TILE,
    comparison_grid,
    flicker_plot,
    frame_strip,
    preview_frames,
    save_png,
    save_video,
    speedup_psnr_plot,
)
from .job import ONE_DEVICE, BenchJob
from .run import BenchResults, RunResult

PLOT_FILE = "speedup-vs-psnr.png"
FLICKER_FILE = "flicker.png"
PSNR_NULL_NOTE = "psnr_db null: identical to the one-device image for at least one prompt (PSNR is infinite)"
#: The columns every report table opens with (:func:`_cells` fills them alike for images and videos).
LEADING_HEADERS = ("run", "latency s", "speedup", "MB/step/rank", "comm wait s", "PSNR dB")
TABLE_HEADERS = (*LEADING_HEADERS, "worst-prompt PSNR dB", "SSIM", "LPIPS")
VIDEO_TABLE_HEADERS = (
    *LEADING_HEADERS,
    "worst-frame PSNR dB",
    "SSIM",
    "worst-frame SSIM",
    "LPIPS",
    "flicker",
    "added flicker",
)


@dataclass
class WrittenReport:
    """What :func:`write_report_files` wrote: the results.json document, the files (in ``out``) and the lines to
    print."""

    out: Path
    document: dict
    files: list[str]
    lines: list[str]


def write_report(job: BenchJob, results: BenchResults) -> list[str]:
    """Write every report file into ``job.out``; returns the lines to print."""
    return write_report_files(job, results).lines


def write_report_files(job: BenchJob, results: BenchResults) -> WrittenReport:
    """Write every report file into ``job.out``: results.json, report.md, report.html and the figures."""
    out = Path(job.out)
    skipped = lpips_unavailable_reason()
    baseline = results.runs[0]
    video = baseline.outputs[0].ndim == 4
    rows = [_row(job, results.prompts, run, baseline, skipped is None, video) for run in results.runs]
    media = _video_figures(out, results, rows) if video else None
    figures = [] if media is None else [*media["strips"], *media["previews"], media["flicker_plot"]]
    for row, run in zip(rows, results.runs, strict=True):
        if row.get("grid"):
            save_png(comparison_grid(run.outputs, baseline.outputs), out / row["grid"])
            figures.append(row["grid"])
    if video:  # the worst frame: infinite, on the plot's "identical" line, only when every frame is identical
        points = [(row["run"], row["speedup"], row["psnr_db_worst"]) for row in rows[1:]]
        speedup_psnr_plot(points, out / PLOT_FILE, "worst-frame PSNR vs one device (dB, any prompt)")
    else:
        speedup_psnr_plot([(row["run"], row["speedup"], row["psnr_db"]) for row in rows[1:]], out / PLOT_FILE)
    figures.append(PLOT_FILE)
    lpips_status = "ok" if skipped is None else f"skipped: {skipped}"
    metrics = metrics_line(skipped)
    config = _config(job, results, video)
    document = {"config": config, "rows": rows, "metrics": ran_metrics(skipped), "lpips": lpips_status}
    if media is not None:
        document["video"] = media
    (out / "results.json").write_text(json.dumps(_json_safe(document), indent=2, allow_nan=False) + "\n")
    table = _markdown_table(rows, video)
    (out / "report.md").write_text(_markdown(config, rows, table, metrics, media))
    (out / "report.html").write_text(_html(config, rows, metrics, media))
    lines = [table, metrics]
    lines.append(f"wrote {out / 'report.html'}, report.md, results.json and the images into {out}")
    return WrittenReport(out, document, ["report.html", "report.md", "results.json", *figures], lines)


def ran_metrics(lpips_skipped: str | None) -> list[str]:
    """The fidelity metrics the report holds."""
    return ["PSNR", "SSIM"] if lpips_skipped is not None else ["PSNR", "SSIM", "LPIPS"]


def metrics_line(lpips_skipped: str | None) -> str:
    """``metrics: PSNR, SSIM, LPIPS``, or ``metrics: PSNR, SSIM; LPIPS skipped: <why>``."""
    line = f"metrics: {', '.join(ran_metrics(lpips_skipped))}"
    return line if lpips_skipped is None else f"{line}; LPIPS skipped: {lpips_skipped}"


#: The keys of each run in ``paradiff bench --json``.
JSON_ROW_KEYS = (
    "run",
    "strategy",
    "warmup",
    "fidelity_floor_db",
    "cache",
    "latency_s",
    "speedup",
    "psnr_db",
    "psnr_db_worst",
    "ssim",
    "ssim_worst",
    "lpips",
    "bytes_per_step",
    "wait_s",
)


def summary_json(written: WrittenReport) -> dict:
    """``paradiff bench --json``'s object: the files written (paths), the metrics and, per run, its figures.

    Every figure is a number, or null: ``psnr_db`` (``psnr_db_worst``) of a run identical to one device on some
    prompt (on every prompt), ``lpips`` when LPIPS was skipped (``lpips`` then says why), ``warmup``, ``strategy``
    and ``cache`` where they do not apply.
    """
    document = written.document
    rows = [{key: row[key] for key in JSON_ROW_KEYS} for row in document["rows"]]
    summary = {
        "out": str(written.out),
        "files": [str(written.out / name) for name in written.files],
        "command": document["config"]["command"],
        "nproc": document["config"]["nproc"],
        "metrics": document["metrics"],
        "lpips": document["lpips"],
        "rows": rows,
    }
    return _json_safe(summary)


def _row(job: BenchJob, prompts: list[str], run: RunResult, baseline: RunResult, with_lpips: bool, video: bool) -> dict:
    score = video_fidelity if video else fidelity
    scores = score(run.outputs, baseline.outputs, with_lpips)
    per_prompt = [
        {
            "prompt": prompt,
            "seed": job.seed + index,
            "latency_s": run.latency_s[index],
            "bytes_per_step": run.bytes_per_step[index],
            "wait_s": run.wait_s[index],
            "refreshed_steps": run.refreshed_steps[index] if run.refreshed_steps else None,
            **scores[index],
        }
        for index, prompt in enumerate(prompts)
    ]
    latency = statistics.median(run.latency_s)
    spec = run.spec
    row = {
        "run": spec.label,
        "strategy": spec.strategy,
        "warmup": spec.warmup,
        "fidelity_floor_db": spec.floor,
        "refreshed": statistics.fmean(map(len, run.refreshed_steps)) if run.refreshed_steps else None,
        "cache": spec.cache,
        "layout": run.layout,
        "latency_s": latency,
        "speedup": statistics.median(baseline.latency_s) / latency,
        "bytes_per_step": statistics.median(run.bytes_per_step),
        "wait_s": statistics.median(run.wait_s),
        "psnr_db": statistics.fmean(score["psnr_db"] for score in scores),
        "ssim": statistics.fmean(score["ssim"] for score in scores),
        "lpips": statistics.fmean(score["lpips"] for score in scores) if with_lpips else None,
    }
    if video:
        return row | _video_figures_of_row(scores) | {"per_prompt": per_prompt}
    grid = None if spec == ONE_DEVICE else f"grid-{re.sub(r'[^A-Za-z0-9.]+', '-', spec.label)}.png"
    worst = {"psnr_db_worst": min(one["psnr_db"] for one in scores), "ssim_worst": min(one["ssim"] for one in scores)}
    return row | worst | {"grid": grid, "per_prompt": per_prompt}


def _video_figures_of_row(scores: list[dict]) -> dict:
    """The worst frame of any prompt, flicker against the one-device video's, and each frame's mean over prompts."""
    flicker = statistics.fmean(score["flicker"] for score in scores)
    flicker_one_device = statistics.fmean(score["flicker_one_device"] for score in scores)
    return {
        "psnr_db_worst": min(score["psnr_db_worst"] for score in scores),
        "ssim_worst": min(score["ssim_worst"] for score in scores),
        "flicker": flicker,
        "flicker_one_device": flicker_one_device,
        "flicker_added": flicker - flicker_one_device,
        "per_frame": {
            name: [statistics.fmean(frame) for frame in zip(*(score["frames"][name] for score in scores), strict=True)]
            for name in ("psnr_db", "ssim")
        },
        "changes": [statistics.fmean(step) for step in zip(*(score["changes"] for score in scores), strict=True)],
    }


def _video_figures(out: Path, results: BenchResults, rows: list[dict]) -> dict:
    """Per prompt a frame strip (PNG) and an animated preview (MP4) of every run, and the flicker plot."""
    labels = [row["run"] for row in rows]
    strips, previews = [], []
    for index in range(len(results.prompts)):
        videos = [(label, run.outputs[index]) for label, run in zip(labels, results.runs, strict=True)]
        strips.append(f"frames-{index + 1}.png")
        save_png(frame_strip(videos), out / strips[-1])
        previews.append(f"preview-{index + 1}.mp4")
        save_video(preview_frames(videos), out / previews[-1])
    flicker_plot([(row["run"], row["changes"]) for row in rows], out / FLICKER_FILE)
    return {
        "frames": len(results.runs[0].outputs[0]),
        "strips": strips,
        "previews": previews,
        "flicker_plot": FLICKER_FILE,
    }


def _config(job: BenchJob, results: BenchResults, video: bool) -> dict:
    first = results.runs[0].outputs[0]
    config = {
        "command": job.command(),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": job.model,
        "strategies": list(job.strategies),
        "warmups": list(job.warmups),
        "fidelity_floors_db": list(job.floors),
        "caches": list(job.caches),
        "nproc": results.world_size,
        "threads_per_rank": job.threads,
        "steps": job.steps,
        "size": first.shape[1 if video else 0],  # the model's own when --size was not given
        "width": first.shape[2 if video else 1],
        "seed": job.seed,
        "prompts": results.prompts,
        "builtin_prompts": not job.prompt_texts,  # False: the user's --prompt / --prompts-file
        "device_option": job.device,
        "dtype_option": job.dtype,
        "dtype": results.dtype or job.dtype,
        "guidance": job.guidance,  # None: the built-in models' own (2), the pipeline's default otherwise
        "negative_prompt": job.negative_prompt,
        "call": dict(job.call),
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "device": results.device,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "notes": _video_notes() if video else _image_notes(),
    }
    if video:
        config["frames"] = len(first)
    return config


def _image_notes() -> list[str]:
    return [
        "latency_s: median over prompts of one image's wall time on rank 0 (VAE decode included)",
        "speedup: one-device median latency / this run's median latency",
        "bytes_per_step, wait_s: rank 0's bytes sent per denoising step and time blocked on communication "
        "per image (paradiff.comm_stats), median over prompts; 0 for one device",
        "psnr_db, ssim, lpips: mean over prompts against the one-device image with the same seed",
        "psnr_db_worst, ssim_worst: the worst prompt's (a fidelity floor holds on every prompt only if it holds there)",
        PSNR_NULL_NOTE,
    ]


def _video_notes() -> list[str]:
    return [
        "latency_s: median over prompts of one video's wall time on rank 0 (VAE decode included)",
        "speedup: one-device median latency / this run's median latency",
        "bytes_per_step, wait_s: rank 0's bytes sent per denoising step and time blocked on communication "
        "per video (paradiff.comm_stats), median over prompts; 0 for one device",
        "psnr_db, ssim, lpips: each frame against the one-device frame with the same seed, mean over frames, "
        "then over prompts; per_frame: each frame's mean over prompts; per_prompt.frames: each frame's",
        "psnr_db_worst, ssim_worst: the worst frame of any prompt (per_prompt.worst_frame: its 0-based number)",
        "ssim of frames: paradiff.metrics.ssim (11-px Gaussian window of sigma 1.5; the figure torchmetrics gives)",
        "flicker: mean absolute change from each frame to the next (pixels in [0, 1]), mean over prompts; "
        "flicker_one_device: the one-device video's; flicker_added: flicker - flicker_one_device, above 0 "
        "where the strategy made frames jump more than one device did; changes: per frame step",
        "psnr_db null: at least one frame identical to the one-device frame (PSNR is infinite); "
        "psnr_db_worst null: every frame identical",
    ]


def _json_safe(value):
    """``value`` with every non-finite float replaced by None (JSON has no inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _decibels(value: float) -> str:
    return f"{value:.1f}" if math.isfinite(value) else "∞"


def _run_cell(row: dict) -> str:
    """The run's label, and the layout it chose at run time as the keyword that repeats it:
    ``asyncdiff warmup=1 (asyncdiff_cut=(3, 3))``."""
    if not row["layout"]:
        return row["run"]
    spelled = (
        f"{name}=({', '.join(map(str, value))})" if isinstance(value, list | tuple) else f"{name}={value}"
        for name, value in row["layout"].items()
    )
    return f"{row['run']} ({', '.join(spelled)})"


def _cells(row: dict, video: bool) -> list[str]:
    lpips = "—" if row["lpips"] is None else f"{row['lpips']:.4f}"
    cells = [
        _run_cell(row),
        f"{row['latency_s']:.2f}",
        f"{row['speedup']:.2f}×",
        f"{row['bytes_per_step'] / 1e6:.2f}",
        f"{row['wait_s']:.2f}",
        _decibels(row["psnr_db"]),
    ]
    if not video:
        return [*cells, _decibels(row["psnr_db_worst"]), f"{row['ssim']:.4f}", lpips]
    return [
        *cells,
        _decibels(row["psnr_db_worst"]),
        f"{row['ssim']:.4f}",
        f"{row['ssim_worst']:.4f}",
        lpips,
        f"{row['flicker']:.4f}",
        f"{round(row['flicker_added'], 4) + 0.0:+.4f}",  # + 0.0: no "-0.0000" for a difference that rounds away
    ]


def _markdown_table(rows: list[dict], video: bool) -> str:
    headers = VIDEO_TABLE_HEADERS if video else TABLE_HEADERS
    return _markdown_grid(headers, [_cells(row, video) for row in rows])


def _markdown_grid(headers: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|---" * len(headers) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _per_frame_table(rows: list[dict]) -> tuple[tuple[str, ...], list[list[str]]]:
    """One line per frame, a PSNR and an SSIM column per parallel run: each frame's mean over prompts."""
    parallel = rows[1:]
    headers = ("frame", *(f"{row['run']} {name}" for row in parallel for name in ("PSNR dB", "SSIM")))
    frames = len(rows[0]["per_frame"]["ssim"])
    lines = [
        [
            str(frame + 1),
            *(
                cell
                for row in parallel
                for cell in (_decibels(row["per_frame"]["psnr_db"][frame]), f"{row['per_frame']['ssim'][frame]:.4f}")
            ),
        ]
        for frame in range(frames)
    ]
    return headers, lines


def _settings(config: dict) -> list[tuple[str, str]]:
    machine = config["machine"]
    frames = f", {config['frames']} frames" if "frames" in config else ""
    return [
        ("command", config["command"]),
        ("date", config["date"]),
        ("model", config["model"]),
        ("size", f"{config['size']}×{config.get('width', config['size'])} px{frames}"),
        ("steps", str(config["steps"])),
        (
            "workload",
            f"--device {config['device_option']}, {config['dtype']} (--dtype {config['dtype_option']}), guidance "
            f"{'default' if config['guidance'] is None else format(config['guidance'], 'g')}"
            + ("" if config["negative_prompt"] is None else f", negative prompt {config['negative_prompt']!r}")
            + ("".join(f", {key}={value!r}" for key, value in config["call"].items())),
        ),
        (
            "ranks",
            f"{config['nproc']} ({config['threads_per_rank']} torch thread(s) per rank, and for the one-device run)",
        ),
        ("machine", f"{machine['cpu_count']} CPUs, {machine['platform']}, Python {machine['python']}"),
        ("torch", machine["torch"]),
        ("device", machine["device"]),
    ]


def _markdown(config: dict, rows: list[dict], table: str, metrics: str, media: dict | None) -> str:
    lines = [f"# paradiff bench: {config['model']}", ""]
    lines += [
        f"- **{name}**: `{value}`" if name == "command" else f"- **{name}**: {value}"
        for name, value in _settings(config)
    ]
    lines += ["", table, "", metrics, ""]
    lines += [f"- {note}" for note in config["notes"]]
    lines += ["", f"![speedup vs PSNR]({PLOT_FILE})", ""]
    for row in rows:
        if row.get("grid"):
            lines += [f"## {row['run']}", "", _grid_caption(), "", f"![{row['run']}]({row['grid']})", ""]
    if media is not None:
        lines += _markdown_video(config, rows, media)
    lines += ["## Prompts", ""]
    lines += [
        f"{index + 1}. {prompt} (seed {config['seed'] + index})" for index, prompt in enumerate(config["prompts"])
    ]
    return "\n".join(lines) + "\n"


def _markdown_video(config: dict, rows: list[dict], media: dict) -> list[str]:
    lines = ["## Flicker", "", _flicker_caption(), "", f"![flicker]({media['flicker_plot']})", ""]
    lines += ["## Frames", "", _strip_caption(), ""]
    for index, (strip, preview) in enumerate(zip(media["strips"], media["previews"], strict=True)):
        lines += [f"### {_prompt_title(config, index)}", "", f"![frames, prompt {index + 1}]({strip})", ""]
        lines += [f"Animated, side by side: [{preview}]({preview})", ""]
    lines += ["## Per frame", "", "Each frame against the one-device frame, mean over prompts.", ""]
    lines += [_markdown_grid(*_per_frame_table(rows)), ""]
    return lines


def _prompt_title(config: dict, index: int) -> str:
    return f"Prompt {index + 1}: {config['prompts'][index]} (seed {config['seed'] + index})"


def _flicker_caption() -> str:
    return (
        "Mean absolute change from each frame to the next, mean over prompts; one device in black. "
        "A run above the black line made its frames jump more than one device did."
    )


def _strip_caption() -> str:
    return (
        f"Up to {STRIP_FRAMES} evenly spaced frames per run (at most {STRIP_TILE} px; the previews have the full "
        "size), one row per run (one device first), each parallel run followed by its difference from one device "
        f"({DIFF_LABEL}, inferno colour map, clipped at 1)."
    )


def _preview_caption() -> str:
    return (
        "Every run side by side, playing in step (one device first); under each parallel run its difference "
        f"from one device ({DIFF_LABEL}, inferno colour map, clipped at 1)."
    )


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


def _html(config: dict, rows: list[dict], metrics: str, media: dict | None) -> str:
    esc = html.escape
    settings = "".join(
        f"<dt>{esc(name)}</dt><dd>{f'<code>{esc(value)}</code>' if name == 'command' else esc(value)}</dd>"
        for name, value in _settings(config)
    )
    video = media is not None
    table = _html_table(VIDEO_TABLE_HEADERS if video else TABLE_HEADERS, [_cells(row, video) for row in rows])
    notes = "".join(f"<li>{esc(note)}</li>" for note in [metrics, *config["notes"]])
    grids = "".join(
        f'<h2>{esc(row["run"])}</h2><p>{esc(_grid_caption())}</p><img src="{esc(row["grid"])}" alt="{esc(row["run"])}">'
        for row in rows
        if row.get("grid")
    )
    if video:
        grids += _html_video(config, rows, media)
    prompts = "".join(
        f"<li>{esc(prompt)} (seed {config['seed'] + index})</li>" for index, prompt in enumerate(config["prompts"])
    )
    title = f"paradiff bench: {config['model']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title><style>{CSS}</style></head>
<body>
<h1>{esc(title)}</h1>
<dl class="settings">{settings}</dl>
{table}
<ul class="notes">{notes}</ul>
<h2>Speedup vs fidelity</h2><img src="{PLOT_FILE}" alt="speedup vs PSNR">
{grids}
<h2>Prompts</h2><ol>{prompts}</ol>
</body></html>
"""


def _html_table(headers: tuple[str, ...], rows: list[list[str]]) -> str:
    esc = html.escape
    header = "".join(f"<th>{esc(name)}</th>" for name in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in cells) + "</tr>" for cells in rows)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def _html_video(config: dict, rows: list[dict], media: dict) -> str:
    esc = html.escape
    previews = "".join(
        f"<h3>{esc(_prompt_title(config, index))}</h3>"
        f'<video src="{esc(preview)}" style="max-width: 100%" autoplay loop muted playsinline controls></video>'
        for index, preview in enumerate(media["previews"])
    )
    return (
        f"<h2>Videos</h2><p>{esc(_preview_caption())}</p>{previews}"
        f"<h2>Flicker</h2><p>{esc(_flicker_caption())}</p>"
        f'<img src="{esc(media["flicker_plot"])}" alt="flicker per frame step">'
        f"<h2>Per frame</h2><p>Each frame against the one-device frame, mean over prompts.</p>"
        f"{_html_table(*_per_frame_table(rows))}"
    )
