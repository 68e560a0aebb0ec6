"""Simple scenes in the vocabulary the built-in model was trained on (size, colour, shape, position, background)."""

from __future__ import annotations

SCENES = (
    "a large red circle at the top left on a white background",
    "a small blue square in the center on a black background",
    "a green triangle at the bottom right on a gray background",
    "a yellow circle on the left on a white background",
    "a large purple square at the top on a gray background",
    "a small orange triangle on the right on a black background",
    "a blue circle at the bottom left on a white background",
    "a large green square at the top right on a black background",
)


def bench_prompts(count: int) -> list[str]:
    """The first ``count`` scenes, cycling through the list when ``count`` is larger."""
    return [SCENES[index % len(SCENES)] for index in range(count)]
