"""Pictures for the report: difference heatmaps, one-device | parallel | difference grids, the speedup-vs-PSNR plot,
and for videos the frame strips, the animated side-by-side previews and the flicker plot."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, ImageDraw, ImageFont

#: Absolute differences are multiplied by this before colour-mapping (clipped at 1), the same for every run.
DIFF_GAIN = 10.0
#: White pixels between the images of a grid.
GAP = 4
#: Frames shown per video in a frame strip (evenly spaced, the first and the last among them).
STRIP_FRAMES = 8
#: The longest side of a frame in a strip, an overview: eight frames and the labels then fit the ~900 px a page
#: shows a markdown image at, and the PNG stays small (four runs: 0.4 MB; at full size, 3 MB for 256-px frames).
#: The previews keep the full size.
STRIP_TILE = 96
#: Frames per second of the animated previews (what ``paradiff generate`` writes its videos at).
PREVIEW_FPS = 8
#: H.264 encodes whole 16-pixel blocks; a preview is padded to them rather than rescaled (which would blur it).
MACRO_BLOCK = 16
#: The row label under each parallel run, for its difference heatmaps.
DIFF_LABEL = f"|difference| x {DIFF_GAIN:g}"  # the default font has no ×


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


def speedup_psnr_plot(
    points: list[tuple[str, float, float]], path: Path, ylabel: str = "PSNR vs one device (dB, mean over prompts)"
) -> None:
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
    axes.set_ylabel(ylabel)
    axes.set_title("speed vs fidelity")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


def frame_indices(count: int, shown: int = STRIP_FRAMES) -> list[int]:
    """``shown`` evenly spaced 0-based frame numbers of a ``count``-frame video, first and last included."""
    return sorted({round(position) for position in np.linspace(0, count - 1, min(shown, count))})


def labelled_grid(cells: list[list[np.ndarray | None]], row_labels: list[str], column_labels: list[str]) -> np.ndarray:
    """Tiles in [0, 1] (all of one size; None leaves a blank) on white, labels left of the rows and above the
    columns, as uint8 RGB. A column is as wide as its label where that is wider than a tile, so that labels
    never run into each other, however small the frames."""
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def text_size(text: str) -> tuple[int, int]:
        left, top, right, bottom = measure.textbbox((0, 0), text, font=font)
        return right - left, bottom

    height, width = next(tile for row in cells for tile in row if tile is not None).shape[:2]
    label_width = max((text_size(label)[0] for label in row_labels), default=0)
    left_margin = label_width + 2 * GAP if label_width else GAP
    header = max((text_size(label)[1] for label in column_labels), default=0) + GAP
    columns = [max(width, text_size(label)[0]) for label in column_labels]
    starts = np.cumsum([left_margin, *(column + GAP for column in columns[:-1])])
    size = (int(starts[-1]) + columns[-1] + GAP, header + len(cells) * (height + GAP) + GAP)
    canvas = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(canvas)
    for start, column, label in zip(starts, columns, column_labels, strict=True):
        draw.text((int(start) + (column - text_size(label)[0]) // 2, GAP // 2), label, fill="#333", font=font)
    for number, (row, label) in enumerate(zip(cells, row_labels, strict=True)):
        top = header + GAP + number * (height + GAP)
        draw.text((GAP, top + (height - text_size(label)[1]) // 2), label, fill="#333", font=font)
        for start, column, tile in zip(starts, columns, row, strict=True):
            if tile is not None:
                pixels = (np.clip(tile, 0.0, 1.0) * 255).round().astype(np.uint8)
                canvas.paste(Image.fromarray(pixels), (int(start) + (column - width) // 2, top))
    return np.asarray(canvas)


def frame_strip(runs: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """Evenly spaced frames of one prompt's videos, one row per run (the one-device video first), each parallel
    run's row followed by its difference heatmaps against the one-device frames; columns labelled by frame."""
    reference = runs[0][1]
    indices = frame_indices(len(reference))
    cells, labels = [[reference[index] for index in indices]], [runs[0][0]]
    for label, video in runs[1:]:
        cells += [[video[index] for index in indices], [difference_heatmap(video[i], reference[i]) for i in indices]]
        labels += [label, DIFF_LABEL]
    shrunk = [[_shrink(tile, STRIP_TILE) for tile in row] for row in cells]
    return labelled_grid(shrunk, labels, [f"frame {index + 1}" for index in indices])


def _shrink(tile: np.ndarray, longest: int) -> np.ndarray:
    """``tile`` (in [0, 1]) with its longest side at most ``longest`` px, each new pixel the mean of those it covers
    (a heatmap keeps a dimmer trace of every difference, where sampling every other pixel would drop some)."""
    height, width = tile.shape[:2]
    scale = max(height, width) / longest
    if scale <= 1:
        return tile
    image = Image.fromarray((np.clip(tile, 0.0, 1.0) * 255).round().astype(np.uint8))
    size = (max(1, round(width / scale)), max(1, round(height / scale)))
    return np.asarray(image.resize(size, Image.Resampling.BOX)) / 255.0


def preview_frames(runs: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
    """The frames of an animation of one prompt's videos side by side (the one-device video first), each parallel
    video above its difference heatmap, so that every run plays in step with the others."""
    reference = runs[0][1]
    labels = [label for label, _ in runs]
    return [
        labelled_grid(
            [
                [video[index] for _, video in runs],
                [None, *(difference_heatmap(video[index], reference[index]) for _, video in runs[1:])],
            ],
            ["", DIFF_LABEL],
            labels,
        )
        for index in range(len(reference))
    ]


def save_video(frames: list[np.ndarray], path: Path, fps: int = PREVIEW_FPS) -> None:
    """An MP4 through diffusers' own writer, as ``paradiff generate`` writes videos, padded white to whole blocks.

    MP4 rather than GIF: a GIF of side-by-side videos and their noisy difference maps is 10x as large
    (750 kB against 60 kB for one 16-frame, 128-px prompt) and has 256 colours for both.
    """
    from diffusers.utils import export_to_video

    height, width = frames[0].shape[:2]
    size = (-(-width // MACRO_BLOCK) * MACRO_BLOCK, -(-height // MACRO_BLOCK) * MACRO_BLOCK)
    padded = []
    for frame in frames:
        canvas = Image.new("RGB", size, "white")
        canvas.paste(Image.fromarray(frame))
        padded.append(canvas)
    export_to_video(padded, str(path), fps=fps)


def flicker_plot(curves: list[tuple[str, list[float]]], path: Path) -> None:
    """Mean absolute change from each frame to the next, one line per run, the one-device run (first) in black:
    a parallel run's line above it is flicker the strategy added."""
    figure = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, (label, changes) in enumerate(curves):
        steps = np.arange(1, len(changes) + 1)
        style = {"color": "black", "linewidth": 2.0} if index == 0 else {"linestyle": "--", "marker": "."}
        axes.plot(steps, changes, label=label, **style)
    axes.set_xlabel("frame step (frame n → n + 1)")
    axes.set_ylabel("mean |change| per pixel (images in [0, 1])")
    axes.set_title("temporal flicker (mean over prompts)")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
