"""Pictures for the report: difference heatmaps, one-device | parallel | difference grids, the speedup-vs-PSNR plot."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

#: Absolute differences are multiplied by this before colour-mapping (clipped at 1), the same for every run.
DIFF_GAIN = 10.0
#: White pixels between the images of a grid.
GAP = 4


def difference_heatmap(image: np.ndarray, reference: np.ndarray, gain: float = DIFF_GAIN) -> np.ndarray:
    """``|image - reference|`` averaged over colour channels, times ``gain``, as an RGB inferno map in [0, 1]."""
    difference = np.abs(np.asarray(image, np.float64) - np.asarray(reference, np.float64)).mean(axis=-1)
    return matplotlib.colormaps["inferno"](np.clip(difference * gain, 0.0, 1.0))[..., :3]


def comparison_grid(images: list[np.ndarray], references: list[np.ndarray]) -> np.ndarray:
    """One row per prompt: one-device image | parallel image | difference heatmap, as uint8 RGB."""
    rows = [
        [reference, image, difference_heatmap(image, reference)]
        for image, reference in zip(images, references, strict=True)
    ]
    height, width = references[0].shape[:2]
    grid = np.ones((len(rows) * (height + GAP) + GAP, 3 * (width + GAP) + GAP, 3))
    for row, tiles in enumerate(rows):
        for column, tile in enumerate(tiles):
            top, left = GAP + row * (height + GAP), GAP + column * (width + GAP)
            grid[top : top + height, left : left + width] = tile
    return (np.clip(grid, 0.0, 1.0) * 255).round().astype(np.uint8)


def save_png(array: np.ndarray, path: Path) -> None:
    Image.fromarray(array).save(path)


def speedup_psnr_plot(points: list[tuple[str, float, float]], path: Path) -> None:
    """Scatter of (label, speedup, PSNR dB) points; identical images (PSNR ``inf``) sit on a line marked ∞."""
    finite = [psnr for _, _, psnr in points if math.isfinite(psnr)]
    ceiling = max(finite, default=40.0) + 10.0
    figure = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, (label, speedup, psnr) in enumerate(points):
        y = psnr if math.isfinite(psnr) else ceiling
        axes.scatter([speedup], [y], color="tab:blue", zorder=3)
        # labels of neighbouring points (e.g. one strategy at several warm-ups) climb in three tiers, not overlap
        lift = 12 * (index % 3)
        leader = {"arrowstyle": "-", "color": "gray", "linewidth": 0.5} if lift else None
        offset = (6, 4 + lift)
        axes.annotate(label, (speedup, y), textcoords="offset points", xytext=offset, fontsize=8, arrowprops=leader)
    if len(finite) < len(points):
        axes.axhline(ceiling, color="gray", linestyle=":", linewidth=1)
        axes.text(0.01, ceiling, " identical (PSNR ∞)", transform=axes.get_yaxis_transform(), va="bottom", fontsize=8)
    axes.axvline(1.0, color="gray", linestyle="--", linewidth=1)
    axes.text(1.0, 0.01, " one device", transform=axes.get_xaxis_transform(), fontsize=8, color="gray")
    axes.margins(x=0.15, y=0.1)
    axes.set_xlabel("speedup vs one device (×)")
    axes.set_ylabel("PSNR vs one device (dB, mean over prompts)")
    axes.set_title("speed vs fidelity")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
