"""Simple scenes in the vocabulary the built-in models were trained on (size, colour, shape, position, background).

Video pipelines get moving scenes in the built-in video model's caption form ("... moving from left to
right ..."): a still scene would make every video nearly static, and flicker only shows against motion.
"""

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

VIDEO_SCENES = (
    "a large red circle moving from left to right on a white background",
    "a small blue square moving from top to bottom on a black background",
    "a green triangle moving from right to left on a gray background",
    "a yellow circle moving from bottom to top on a white background",
    "a large purple square moving from right to left on a gray background",
    "a small orange triangle moving from top to bottom on a black background",
    "a blue circle moving from left to right on a white background",
    "a large green square moving from bottom to top on a black background",
)


def bench_prompts(count: int, video: bool = False) -> list[str]:
    """The first ``count`` scenes (moving ones for a video pipeline), cycling through the list when ``count`` is
    larger."""
    scenes = VIDEO_SCENES if video else SCENES
    return [scenes[index % len(scenes)] for index in range(count)]
