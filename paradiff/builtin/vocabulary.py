"""The words ``paradiff-tiny`` knows, and a warning naming the words of a prompt it does not.

Its tokenizer is word-level over the captions' vocabulary (lower-cased, anything but letters a space):
any other word becomes the unknown token, which the model never saw in training, so a prompt with
"big" or "middle" in it is drawn as if those words were noise (the shape's colour can go with them).
:func:`warn_unknown_words` says so, naming the words and listing the ones it knows.
"""

from __future__ import annotations

import re
import sys
import warnings

from ..errors import ParadiffWarning
from .clips import DIRECTIONS
from .scenes import BACKGROUNDS, COLOURS, PLACES, SHAPES, SIZES, VOCABULARY

#: The vocabulary by role, in the order the warning lists it (backgrounds go in "on a ... background").
KNOWN_WORDS = {
    "shapes": list(SHAPES),
    "sizes": list(SIZES),
    "colours": list(COLOURS),
    "backgrounds": list(BACKGROUNDS),
    "places": list(PLACES),
}

#: Prompts both built-in pipelines draw (the README's examples): the U-Net at 128 px and the DiT at 256 px
#: put the asked colour in the asked place on the asked background for each of seeds 0-7 (tests check
#: them). Two-shape prompts ("... and ...") are in the training data, but the model rarely draws both
#: colours in place, and small triangles often come out in no palette colour at all.
EXAMPLE_PROMPTS = (
    "a large red circle at the top left on a white background",
    "a small blue square in the center on a black background",
    "a large yellow square on the right on a gray background",
    "a large purple circle at the bottom on a white background",
    "a large blue circle at the top on a white background",
)

#: The README's video examples (a test keeps the README to these); the video model draws their colour, moving.
VIDEO_EXAMPLE_PROMPTS = (
    "a large red circle moving from left to right on a white background",
    "a large blue square moving from top to bottom on a black background",
)

#: Common words outside the vocabulary, and what to say instead.
SUGGESTIONS = {
    "big": "large",
    "huge": "large",
    "tiny": "small",
    "little": "small",
    "middle": "in the center",
    "centre": "in the center",
    "central": "in the center",
    "centered": "in the center",
    "upper": "at the top",
    "lower": "at the bottom",
    "grey": "gray",
    "violet": "purple",
    "circles": "circle",
    "squares": "square",
    "triangles": "triangle",
    "disc": "circle",
    "dot": "circle",
    "ball": "circle",
    "rectangle": "square",
    "box": "square",
}


def prompt_words(prompt: str) -> list[str]:
    """The words the built-in tokenizer splits ``prompt`` into: lower-cased runs of letters."""
    return re.findall("[a-z]+", prompt.lower())


def unknown_words(prompt: str, kind: str = "sd") -> list[str]:
    """The words of ``prompt`` outside the built-in ``kind`` model's vocabulary, each once, in prompt order.

    The video model (``kind="video"``) knows the pictures' words, "moving", and the direction phrases
    ("from left to right", ...) as wholes: "from" or "to" elsewhere is unknown to it.
    """
    known = set(VOCABULARY)
    if kind == "video":
        known.add("moving")
        prompt = " ".join(prompt_words(prompt))
        for phrase in DIRECTIONS:
            prompt = prompt.replace(phrase, " ")
    return list(dict.fromkeys(word for word in prompt_words(prompt) if word not in known))


def unknown_words_message(words: list[str], kind: str = "sd") -> str:
    """The warning's text for ``words`` (unknown to the built-in model): what happens, what to say instead."""
    hints = [f"{word!r} -> {SUGGESTIONS[word]!r}" for word in words if word in SUGGESTIONS]
    roles = {role: ", ".join(names) for role, names in KNOWN_WORDS.items()}
    roles["backgrounds"] += f" (as in 'on a {KNOWN_WORDS['backgrounds'][0]} background')"
    if kind == "video":
        roles = {role: names for role, names in roles.items() if role != "places"}
        roles["motions"] = ", ".join(f"moving {phrase}" for phrase in DIRECTIONS)
    known = "; ".join(f"{role} {names}" for role, names in roles.items())
    it, they = ("it", "it") if len(words) == 1 else ("each", "they")
    picture, example = ("video", VIDEO_EXAMPLE_PROMPTS[0]) if kind == "video" else ("picture", EXAMPLE_PROMPTS[0])
    joined = "" if kind == "video" else "; 'and' between two shapes"
    return (
        f"the built-in model does not know {', '.join(repr(word) for word in words)}: it reads {it} as an "
        f"unknown token, and the {picture} may lose what {they} described"
        + (f" (try {', '.join(hints)})" if hints else "")
        + f". It knows only these words: {known}{joined}. "
        f"For example {example!r}."
    )


def warn_unknown_words(prompt: str, stacklevel: int = 2, kind: str = "sd") -> list[str]:
    """Warn (:class:`~paradiff.errors.ParadiffWarning`) if ``prompt`` has words the built-in model does not know.

    Returns those words (empty: no warning). The warning names them, suggests a known word for common
    ones ("big" -> "large") and lists the vocabulary by role (shapes, sizes, colours, backgrounds,
    places, or for the video model motions). Under a process group only rank 0 warns, so a job warns once.
    """
    words = unknown_words(prompt, kind)
    if words and _is_rank_zero():
        warnings.warn(unknown_words_message(words, kind), ParadiffWarning, stacklevel=stacklevel)
    return words


def _is_rank_zero() -> bool:
    """True without a process group (torch.distributed not even imported counts) or on its rank 0."""
    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
