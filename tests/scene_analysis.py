"""A simple colour/place reading of a picture, and of a clip's motion (``paradiff.builtin.follow`` reads a
one-shape picture whole: kind, colour share, place and background)."""

from __future__ import annotations

import numpy as np

from paradiff.builtin.clips import DIRECTIONS
from paradiff.builtin.follow import MIN_TRAVEL, background_of, place_of, rgb255
from paradiff.builtin.scenes import BACKGROUNDS, COLOURS, PLACES

_PALETTE_NAMES = [*COLOURS, *(f"background {name}" for name in BACKGROUNDS)]
_PALETTE = np.array([*COLOURS.values(), *BACKGROUNDS.values()], dtype=np.float64)
#: A colour must cover at least this share of the picture to count as drawn (a small shape covers ~3%).
MIN_AREA = 0.006


def centroid_of(image: np.ndarray, colour: str, min_area: float = MIN_AREA) -> tuple[float, float] | None:
    """Where ``colour`` sits in an (H, W, 3) uint8 or [0, 1] float image, ``(x, y)`` as fractions of the side, or None.

    Every pixel takes the name of its nearest palette colour; the pixels named ``colour`` must cover
    ``min_area`` of the picture, and their centroid is the answer. Both are fractions of the picture,
    so the reading does not depend on its size in pixels.
    """
    pixels = rgb255(image)
    distance = ((pixels[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)
    mask = distance.argmin(-1) == _PALETTE_NAMES.index(colour)
    if mask.mean() < min_area:
        return None
    rows, cols = np.nonzero(mask)
    height, width = mask.shape
    return cols.mean() / width, rows.mean() / height


def where_is(image: np.ndarray, colour: str, min_area: float = MIN_AREA) -> str | None:
    """The cell where ``colour`` sits in an (H, W, 3) uint8 or [0, 1] float image, or None if it is absent."""
    centroid = centroid_of(image, colour, min_area)
    return None if centroid is None else place_of(*centroid)


def asked_by(prompt: str) -> tuple[list[tuple[str, str | None]], str | None]:
    """What a caption-style prompt asks for: ``([(colour, place or None), ...], background or None)``.

    One ``(colour, place)`` per shape (shapes are joined by " and "); the place is the longest place
    phrase in that shape's words ("at the top left", not "at the top").
    """
    shapes, background = [], None
    for name in BACKGROUNDS:
        if f"on a {name} background" in prompt:
            background = name
            prompt = prompt.replace(f"on a {name} background", "")
    for part in prompt.split(" and "):
        colour = next((word for word in part.split() if word in COLOURS), None)
        if colour is None:
            raise ValueError(f"no colour in {part!r}")
        place = max((phrase for phrase in PLACES if f" {phrase} " in f" {part} "), key=len, default=None)
        shapes.append((colour, place))
    return shapes, background


def misses(image: np.ndarray, prompt: str) -> list[str]:
    """What ``image`` gets wrong of ``prompt`` (empty: followed), e.g. ``["red: absent", "background: black"]``.

    Each asked colour must be present, in the asked place if the prompt names one; the background
    must be the asked one if the prompt names one.
    """
    shapes, background = asked_by(prompt)
    wrong = []
    for colour, place in shapes:
        found = where_is(image, colour)
        if found is None or (place is not None and found != place):
            wrong.append(f"{colour}: {found or 'absent'}")
    if background is not None and background_of(image) != background:
        wrong.append(f"background: {background_of(image)}")
    return wrong


def follows(image: np.ndarray, prompt: str) -> bool:
    """Whether ``image`` shows every colour ``prompt`` asks for, where it asks, on the asked background."""
    return not misses(image, prompt)


def travel_of(frames: np.ndarray, prompt: str) -> float | None:
    """How far the asked colour moves the asked way in a clip ``(F, H, W, 3)`` (a fraction of the side;
    negative: the other way), or None if the colour is missing from the first or the last quarter of the
    frames: between the mean centroids of those two quarters, along the prompt's direction."""
    colour = next(word for word in prompt.split() if word in COLOURS)
    direction = next(phrase for phrase in DIRECTIONS if phrase in prompt)
    quarter = max(1, len(frames) // 4)
    ends = []
    for part in (frames[:quarter], frames[-quarter:]):
        found = [centroid for centroid in (centroid_of(frame, colour) for frame in part) if centroid is not None]
        if not found:
            return None
        ends.append(np.mean(found, axis=0))
    return float(np.dot(ends[1] - ends[0], DIRECTIONS[direction]))


def motion_misses(frames: np.ndarray, prompt: str) -> list[str]:
    """What a clip gets wrong of a one-shape motion prompt (empty: followed): the asked colour must be found
    (:func:`travel_of`) and move the asked way by at least :data:`MIN_TRAVEL` of the side."""
    colour = next(word for word in prompt.split() if word in COLOURS)
    travel = travel_of(frames, prompt)
    if travel is None:
        return [f"{colour}: absent"]
    return [] if travel >= MIN_TRAVEL else [f"{colour}: moved {travel:+.2f} the asked way"]
