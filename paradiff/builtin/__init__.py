"""``paradiff-tiny``: the small trained pipelines shipped with paradiff (see :mod:`paradiff.builtin.train`).

One folder, ``paradiff-tiny/``, holds the shared components (VAE, text encoder, tokenizer) and two
pipeline folders on top of them: ``sd/`` (``StableDiffusionPipeline`` with a U-Net) and ``pixart/``
(``PixArtAlphaPipeline`` with a DiT). Each pipeline folder links the shared components, so both load
with a plain ``from_pretrained(folder)``, offline.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ParadiffError

WEIGHTS = Path(__file__).with_name("paradiff-tiny")
PIPELINES = ("sd", "pixart")
#: The classifier-free guidance each pipeline is meant to run at. The pipelines' own defaults (7.5 for
#: SD, 4.5 for PixArt) push this small model's colours into their neighbours (orange into yellow, purple
#: into blue); these values were picked on prompts other than the tests' (see README).
GUIDANCE_SCALE = {"sd": 2.0, "pixart": 2.0}


def pipeline_folder(kind: str) -> Path:
    """The folder ``from_pretrained`` loads the built-in ``kind`` pipeline from."""
    if kind not in PIPELINES:
        raise ParadiffError(f"unknown built-in pipeline {kind!r}; use one of {', '.join(PIPELINES)}")
    folder = WEIGHTS / kind
    if not (folder / "model_index.json").is_file():
        raise ParadiffError(
            f"the built-in weights are missing from {folder}; reinstall paradiff or rebuild them with "
            "`python -m paradiff.builtin.train`"
        )
    return folder
