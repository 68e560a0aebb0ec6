"""How far a picture (or a clip) follows a one-shape prompt, read from its pixels alone.

The reading shares nothing with the code that drew the training data but the palette and the place words:
the background is the palette background nearest the median of the picture's border; the shape is the largest
connected region of pixels away from that background; its kind is whichever of three templates fitted to the
region's bounding box (an ellipse, the box itself, a triangle standing on the box's bottom side) overlaps it
best, and none when even the best covers less than :data:`MIN_FIT` of their union or the box is far from
square; its colour is the share of its pixels (less a rim of a pixel or two, where edges blend into the background)
whose nearest palette colour is the asked one; its place is the
3x3 cell of its centroid. A patchy region, one in two colours, or one with stray spots around it scores low on
fit or colour share, where reading only "is there enough of the asked colour near the asked place" would
count it as followed. A clip is read frame by frame (:func:`judge_clip`): the shape kept, in its colour, and
moving the asked way.

Needs ``scipy`` (the ``bench`` and ``test`` extras) for the connected regions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .clips import DIRECTIONS
from .scenes import BACKGROUNDS, COLOURS, PLACES, SHAPES, shapes_named

#: A pixel belongs to the foreground when it lies this far (RGB distance, of 255) from the background.
FOREGROUND_DISTANCE = 60.0
#: The least overlap (intersection over union) of the region and its best template for a kind to be read.
MIN_FIT = 0.75
#: The widest width/height ratio of the region's box read as a shape (a circle's and a square's is 1, the
#: triangle's 1.1).
MAX_ASPECT = 1.35
#: The least share of the shape's pixels in the asked colour for the colour to count as right.
MIN_COLOUR_SHARE = 0.85
#: A region smaller than this share of the picture is no shape (a small shape covers about 3%).
MIN_AREA = 0.005

_SHAPE_COLOURS = np.array(list(COLOURS.values()), dtype=np.float64)
#: The 3x3 grid's cells, row by row, as the caption words name them.
_CELLS = (
    ("at the top left", "at the top", "at the top right"),
    ("on the left", "in the center", "on the right"),
    ("at the bottom left", "at the bottom", "at the bottom right"),
)
assert {cell for row in _CELLS for cell in row} == set(PLACES)


@dataclass(frozen=True)
class Asked:
    """What a one-shape prompt asks for; ``None`` where the prompt does not say."""

    kind: str
    colour: str
    place: str
    background: str | None

    @classmethod
    def of(cls, prompt: str) -> Asked:
        named = shapes_named(prompt)
        if len(named) != 1:
            raise ValueError(f"the follow measure reads one-shape prompts; {prompt!r} names {len(named)}")
        background = next((name for name in BACKGROUNDS if f"on a {name} background" in prompt), None)
        return cls(*named[0], background)


@dataclass(frozen=True)
class Reading:
    """What a picture shows: its background, and of its largest region the kind, fit, colour shares and place."""

    background: str
    kind: str | None
    fit: float
    colour_shares: dict[str, float]
    place: str | None
    #: The region's centroid ``(x, y)``, fractions of the side.
    centre: tuple[float, float] | None

    def colour_share(self, colour: str) -> float:
        return self.colour_shares.get(colour, 0.0)


def rgb255(image: np.ndarray) -> np.ndarray:
    """An ``(H, W, 3)`` uint8 or ``[0, 1]`` float picture as float RGB of 255."""
    pixels = np.asarray(image, dtype=np.float64)
    return pixels * 255 if pixels.max() <= 1.0 else pixels


def background_of(image: np.ndarray) -> str:
    """The palette background nearest the median of the picture's border."""
    return _border_background(rgb255(image))[0]


def _border_background(pixels: np.ndarray) -> tuple[str, np.ndarray]:
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    median = np.median(border, axis=0)
    name = min(BACKGROUNDS, key=lambda n: float(np.sum((median - np.array(BACKGROUNDS[n])) ** 2)))
    return name, median


def place_of(x: float, y: float) -> str:
    """The caption phrase of the 3x3 cell holding the point (x, y), both fractions of the side."""
    return _CELLS[min(int(y * 3), 2)][min(int(x * 3), 2)]


def _templates(height: int, width: int) -> dict[str, np.ndarray]:
    """Each kind's ideal mask filling a ``height`` x ``width`` box."""
    rows = (np.arange(height)[:, None] + 0.5) / height
    cols = (np.arange(width)[None, :] + 0.5) / width
    return {
        "circle": (2 * rows - 1) ** 2 + (2 * cols - 1) ** 2 <= 1,
        "square": np.ones((height, width), dtype=bool),
        "triangle": np.abs(2 * cols - 1) <= rows,
    }


def read(image: np.ndarray) -> Reading:
    """Read a picture (``(H, W, 3)``, uint8 or ``[0, 1]`` floats) as described in this module's docstring."""
    from scipy import ndimage

    pixels = rgb255(image)
    background, median = _border_background(pixels)
    foreground = np.sqrt(((pixels - median) ** 2).sum(-1)) > FOREGROUND_DISTANCE
    labels, count = ndimage.label(foreground)
    if count == 0:
        return Reading(background, None, 0.0, {}, None, None)
    sizes = np.bincount(labels.ravel())[1:]
    region = labels == 1 + int(sizes.argmax())
    if region.mean() < MIN_AREA:
        return Reading(background, None, 0.0, {}, None, None)
    rows, cols = np.nonzero(region)
    box = region[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    fits = {kind: (box & mask).sum() / (box | mask).sum() for kind, mask in _templates(*box.shape).items()}
    kind = max(fits, key=fits.get)
    aspect = max(box.shape) / min(box.shape)
    inside = ndimage.binary_erosion(region, iterations=1 + max(region.shape) // 256)
    nearest = ((pixels[inside if inside.any() else region][:, None, :] - _SHAPE_COLOURS[None]) ** 2).sum(-1).argmin(-1)
    shares = np.bincount(nearest, minlength=len(COLOURS)) / len(nearest)
    height, width = region.shape
    centre = (cols.mean() / width, rows.mean() / height)
    return Reading(
        background=background,
        kind=kind if fits[kind] >= MIN_FIT and aspect <= MAX_ASPECT else None,
        fit=float(fits[kind]),
        colour_shares={name: float(share) for name, share in zip(COLOURS, shares, strict=True)},
        place=place_of(*centre),
        centre=centre,
    )


#: The four checks of :func:`judge`, in the order reports list them.
CHECKS = ("shape", "colour", "place", "background")


def judge(image: np.ndarray, prompt: str) -> dict[str, bool]:
    """Whether the picture gets each of :data:`CHECKS` of a one-shape ``prompt`` right.

    ``shape``: the largest region is read as the asked kind; ``colour``: at least :data:`MIN_COLOUR_SHARE` of its
    pixels are nearest the asked colour; ``place``: its centroid lies in the asked cell; ``background``: the
    asked one (right whenever the prompt names none).
    """
    asked, reading = Asked.of(prompt), read(image)
    return {
        "shape": reading.kind == asked.kind,
        "colour": reading.colour_share(asked.colour) >= MIN_COLOUR_SHARE,
        "place": reading.place == asked.place,
        "background": asked.background in (None, reading.background),
    }


#: The checks of :func:`judge_clip`.
CLIP_CHECKS = ("shape", "colour", "direction", "background")
#: The least share of a clip's frames whose region must read as the asked kind, and in the asked colour.
MIN_FRAME_SHARE = 0.8
#: How far (a fraction of the side) the shape must travel the asked way between the mean centroids of the
#: first and the last quarter of the frames.
MIN_TRAVEL = 0.15


def judge_clip(frames: np.ndarray, prompt: str) -> dict[str, bool]:
    """Whether a clip ``(F, H, W, 3)`` gets each of :data:`CLIP_CHECKS` of a one-shape motion prompt right.

    ``shape`` and ``colour``: at least :data:`MIN_FRAME_SHARE` of the frames pass :func:`judge`'s check (the
    shape is kept across the frames); ``direction``: the shape travels the asked way by :data:`MIN_TRAVEL`;
    ``background``: the first frame's is the asked one.
    """
    words = prompt.split()
    kind = next(word for word in words if word in SHAPES)
    colour = next(word for word in words if word in COLOURS)
    direction = next(phrase for phrase in DIRECTIONS if phrase in prompt)
    background = next((name for name in BACKGROUNDS if f"on a {name} background" in prompt), None)
    readings = [read(frame) for frame in frames]
    quarter = max(1, len(readings) // 4)
    ends = [[r.centre for r in part if r.centre is not None] for part in (readings[:quarter], readings[-quarter:])]
    travel = np.dot(np.mean(ends[1], 0) - np.mean(ends[0], 0), DIRECTIONS[direction]) if all(ends) else -1.0
    return {
        "shape": bool(np.mean([r.kind == kind for r in readings]) >= MIN_FRAME_SHARE),
        "colour": bool(np.mean([r.colour_share(colour) >= MIN_COLOUR_SHARE for r in readings]) >= MIN_FRAME_SHARE),
        "direction": bool(travel >= MIN_TRAVEL),
        "background": background in (None, readings[0].background),
    }


def rates(judgements: list[dict[str, bool]]) -> dict[str, float]:
    """The share of :func:`judge`'s (or :func:`judge_clip`'s) judgements that get each check right, and ``all``
    of them at once."""
    if not judgements:
        raise ValueError("no pictures were judged")
    result = {check: float(np.mean([judged[check] for judged in judgements])) for check in judgements[0]}
    result["all"] = float(np.mean([all(judged.values()) for judged in judgements]))
    return result
