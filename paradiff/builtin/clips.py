"""Captioned clips of one shape moving across a plain background: the training data of ``paradiff-tiny-video``.

A clip is :data:`FRAMES` frames of one flat-coloured shape travelling in a straight line at constant
speed, e.g. "a large red circle moving from left to right on a white background": from the middle of
one edge's third of the frame to the middle of the opposite one (the pictures' "on the left" to "on the
right"), through the centre, give or take a small jitter as in the pictures. A caption then says all
there is to draw, so the small model learns one clip per caption rather than the average of many; with
the start or the line left random (an earlier run), it drew smeared, broken blobs and followed none of
the held-out prompts. As in the picture captions, some captions leave out the size or the background.
Everything is drawn from a seeded ``random.Random``, so ``make_clips(n, seed)`` is reproducible.

:data:`TEST_PROMPTS` are held out: no training clip has the shape, size, colour, background and
direction of one of them, so the prompt-following test draws videos the model never saw.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .scenes import BACKGROUNDS, COLOURS, SHAPES, SIZES, UNET_IMAGE_SIZE, draw_shape, kinds_covering, kinds_differ

#: Frames per clip: the video model's length.
FRAMES = 16
#: Where the shape's centre starts and ends along its line, as a fraction of the side from the edge it
#: leaves and the edge it reaches (the pictures' left and right places), and the jitter of each.
EDGE, JITTER = 0.22, 0.04
#: Phrase -> unit direction of travel (x right, y down).
DIRECTIONS = {
    "from left to right": (1, 0),
    "from right to left": (-1, 0),
    "from top to bottom": (0, 1),
    "from bottom to top": (0, -1),
}
#: The one token the video model's tokenizer reads each direction phrase as. Word by word, "from left to
#: right" and "from right to left" differ only in order; an earlier run whose tokenizer read them word by
#: word moved the shape the opposite way about as often as the asked way.
DIRECTION_TOKENS = {phrase: phrase.replace(" ", "_") for phrase in DIRECTIONS}
#: The tokens the clips' captions add to the pictures' vocabulary.
MOTION_WORDS = ["moving", *DIRECTION_TOKENS.values()]
REVERSED = {"from left to right": "from right to left", "from top to bottom": "from bottom to top"}
REVERSED |= {after: before for before, after in REVERSED.items()}


@dataclass(frozen=True)
class Motion:
    """What a clip shows, without the caption's wording: the key the held-out prompts are checked on."""

    kind: str
    colour: str
    size: str
    background: str
    direction: str

    def caption(self, with_size: bool = True, with_background: bool = True) -> str:
        words = f"{self.size} {self.colour}" if with_size else self.colour
        article = "an" if words[0] in "aeiou" else "a"
        caption = f"{article} {words} {self.kind} moving {self.direction}"
        return caption + (f" on a {self.background} background" if with_background else "")

    def reversed(self) -> Motion:
        return Motion(self.kind, self.colour, self.size, self.background, REVERSED[self.direction])


@dataclass(frozen=True)
class Clip:
    motion: Motion
    caption: str
    #: Where the shape's centre starts and ends, as fractions of the side.
    start: tuple[float, float]
    end: tuple[float, float]

    def draw(self, size: int = UNET_IMAGE_SIZE) -> np.ndarray:
        """The clip as an ``(FRAMES, size, size, 3)`` uint8 array (frames drawn at 2x and downsampled)."""
        big, motion = 2 * size, self.motion
        frames = []
        for index in range(FRAMES):
            x, y = self.centre(index)
            image = Image.new("RGB", (big, big), BACKGROUNDS[motion.background])
            draw_shape(
                ImageDraw.Draw(image), motion.kind, COLOURS[motion.colour], (x * big, y * big), SIZES[motion.size] * big
            )
            frames.append(np.asarray(image.resize((size, size), Image.Resampling.LANCZOS)))
        return np.stack(frames)

    def centre(self, index: int) -> tuple[float, float]:
        """Where the shape's centre is in frame ``index``, as fractions of the side."""
        share = index / (FRAMES - 1)
        x, y = (a + share * (b - a) for a, b in zip(self.start, self.end, strict=True))
        return x, y

    def kind_regions(self, size: int = UNET_IMAGE_SIZE) -> np.ndarray:
        """Each frame's kind region, ``(FRAMES, size, size)`` bool: the pixels that a circle, a square and a
        triangle of the shape's size, where it is in that frame, do not all cover or all leave bare (as a
        picture's, :meth:`~paradiff.builtin.scenes.Scene.kind_region`)."""
        return np.stack([kinds_differ(covered) for covered in self._kinds_covering(size)])

    def shape_regions(self, size: int = UNET_IMAGE_SIZE) -> np.ndarray:
        """Each frame's shape region, ``(FRAMES, size, size)`` bool: the pixels that a shape of any kind would cover
        there, where the asked colour shows (as a picture's, :meth:`~paradiff.builtin.scenes.Scene.shape_region`)."""
        return np.stack([np.logical_or.reduce(covered) for covered in self._kinds_covering(size)])

    def _kinds_covering(self, size: int) -> list[list[np.ndarray]]:
        """Per frame, the pixels a circle, a square and a triangle of the shape's size where it is would cover."""
        diameter = SIZES[self.motion.size] * size
        centres = (self.centre(index) for index in range(FRAMES))
        return [kinds_covering((x * size, y * size), diameter, size) for x, y in centres]

    def reversed(self) -> Clip:
        """The clip played backwards: the same frames in reverse order, captioned with the opposite direction."""
        caption = self.caption.replace(self.motion.direction, REVERSED[self.motion.direction])
        return Clip(self.motion.reversed(), caption, self.end, self.start)


def _test_motions() -> tuple[Motion, ...]:
    """Every colour in every direction, with shapes, sizes and backgrounds taken in turn."""
    pairs = itertools.product(sorted(COLOURS), DIRECTIONS)
    return tuple(
        Motion(SHAPES[i % 3], colour, sorted(SIZES)[i // 3 % 2], sorted(BACKGROUNDS)[i % 3], direction)
        for i, (colour, direction) in enumerate(pairs)
    )


TEST_MOTIONS = _test_motions()
#: The 24 prompts the prompt-following test draws; no training clip shows any of them.
TEST_PROMPTS = tuple(motion.caption() for motion in TEST_MOTIONS)


def random_clip(rng: random.Random) -> Clip:
    """One clip whose motion (and whose reversal's) is not held out."""
    while True:
        direction = rng.choice(sorted(DIRECTIONS))
        motion = Motion(
            rng.choice(SHAPES),
            rng.choice(sorted(COLOURS)),
            rng.choice(sorted(SIZES)),
            rng.choice(sorted(BACKGROUNDS)),
            direction,
        )
        if motion not in TEST_MOTIONS and motion.reversed() not in TEST_MOTIONS:
            break
    caption = motion.caption(with_size=rng.random() < 0.8, with_background=rng.random() < 0.85)
    jitter = [rng.uniform(-JITTER, JITTER) for _ in range(3)]
    return _clip_along(motion, caption, EDGE + jitter[0], 1 - EDGE + jitter[1], 0.5 + jitter[2])


def middle_clip(motion: Motion) -> Clip:
    """The clip of ``motion`` with its full caption along the middle of the frame, no jitter: what its prompt asks
    for, drawn as the training clips are."""
    return _clip_along(motion, motion.caption(), EDGE, 1 - EDGE, 0.5)


def _clip_along(motion: Motion, caption: str, first: float, last: float, across: float) -> Clip:
    """The clip whose shape's centre goes from ``first`` to ``last`` of the side along its direction's axis,
    measured from the edge it leaves, at ``across`` on the other axis."""
    dx, dy = DIRECTIONS[motion.direction]
    along = (first, last) if dx + dy > 0 else (1 - first, 1 - last)
    start, end = ((a, across) for a in along) if dx else ((across, a) for a in along)
    return Clip(motion, caption, start, end)


def make_clips(count: int, seed: int) -> list[Clip]:
    rng = random.Random(seed)
    return [random_clip(rng) for _ in range(count)]
