"""A simple colour/place reading of a picture, to check that generated images follow their prompt."""

from __future__ import annotations

import numpy as np

from paradiff.builtin.scenes import BACKGROUNDS, COLOURS, PLACES

_PALETTE_NAMES = [*COLOURS, *(f"background {name}" for name in BACKGROUNDS)]
_PALETTE = np.array([*COLOURS.values(), *BACKGROUNDS.values()], dtype=np.float64)
#: A colour must cover at least this share of the picture to count as drawn (a small shape covers ~3%).
MIN_AREA = 0.006


def place_of(x: float, y: float) -> str:
    """The caption phrase of the 3x3 cell holding the point (x, y), both fractions of the side."""
    column, row = min(int(x * 3), 2), min(int(y * 3), 2)
    cells = {(0, 0): "at the top left", (1, 0): "at the top", (2, 0): "at the top right", (0, 1): "on the left"}
    cells |= {(1, 1): "in the center", (2, 1): "on the right", (0, 2): "at the bottom left", (1, 2): "at the bottom"}
    cells[(2, 2)] = "at the bottom right"
    assert set(cells.values()) == set(PLACES)
    return cells[(column, row)]


def where_is(image: np.ndarray, colour: str) -> str | None:
    """The cell where ``colour`` sits in an (H, W, 3) uint8 or [0, 1] float image, or None if it is absent.

    Every pixel takes the name of its nearest palette colour; the pixels named ``colour`` must cover
    ``MIN_AREA`` of the picture, and their centroid gives the cell.
    """
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.max() <= 1.0:
        pixels = pixels * 255
    distance = ((pixels[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)
    mask = distance.argmin(-1) == _PALETTE_NAMES.index(colour)
    if mask.mean() < MIN_AREA:
        return None
    rows, cols = np.nonzero(mask)
    height, width = mask.shape
    return place_of(cols.mean() / width, rows.mean() / height)


def background_of(image: np.ndarray) -> str:
    """The background colour name: the palette background nearest to the median of the picture's border."""
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.max() <= 1.0:
        pixels = pixels * 255
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    median = np.median(border, axis=0)
    names = list(BACKGROUNDS)
    distances = [np.sum((median - np.array(BACKGROUNDS[name])) ** 2) for name in names]
    return names[int(np.argmin(distances))]
