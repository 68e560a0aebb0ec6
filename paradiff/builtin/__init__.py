"""``paradiff-tiny``: the small trained pipelines shipped with paradiff (see :mod:`paradiff.builtin.train`).

One folder, ``paradiff-tiny/``, holds the shared components (VAE, text encoder, tokenizer) and three
pipeline folders on top of them: ``sd/`` (``StableDiffusionPipeline`` with a U-Net), ``pixart/``
(``PixArtAlphaPipeline`` with a DiT) and ``video/`` (``AnimateDiffSDXLPipeline``: the picture U-Net with
motion modules, trained on clips by :mod:`paradiff.builtin.motion_train`; its own tokenizer and pooling text
encoder add the motion words). Each pipeline folder links the components it shares, so each loads with a plain
``from_pretrained(folder)``, offline. Prompts must use the captions' words (:func:`unknown_words`,
:func:`warn_unknown_words`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ParadiffError
from .clips import FRAMES
from .scenes import UNET_IMAGE_SIZE
from .vocabulary import EXAMPLE_PROMPTS, VIDEO_EXAMPLE_PROMPTS, unknown_words, warn_unknown_words

__all__ = [
    "DEFAULT_SIZE",
    "EXAMPLE_PROMPTS",
    "FRAMES",
    "GUIDANCE_SCALE",
    "OWN_STEPS",
    "PIPELINES",
    "VIDEO_EXAMPLE_PROMPTS",
    "WEIGHTS",
    "call_kwargs",
    "pipeline_folder",
    "unknown_words",
    "warn_unknown_words",
]

WEIGHTS = Path(__file__).with_name("paradiff-tiny")
PIPELINES = ("sd", "pixart", "video")
#: The classifier-free guidance each pipeline is meant to run at. The pipelines' own defaults (7.5 for
#: SD, 4.5 for PixArt) push this small model's colours into their neighbours (orange into yellow, purple
#: into blue); these values were picked on prompts other than the tests' (see README).
GUIDANCE_SCALE = {"sd": 2.0, "pixart": 2.0, "video": 2.0}
#: The picture size (px) each pipeline is drawn at by default. The U-Net was trained at 128 px and tells
#: places apart only there (its 4x4 bottleneck's zero padding marks the 3x3 grid; at 256 px and up it
#: repeats shapes along the borders). The DiT draws at its training size, 256 px, where its 2x2-latent
#: patches make 256 tokens, enough work for 2 CPU ranks to beat one (``benchmarks/builtin_default_bench.py``);
#: larger, its edges fray. The video model is the U-Net with motion modules and draws at the U-Net's training size,
#: the clips' too.
DEFAULT_SIZE = {"sd": UNET_IMAGE_SIZE, "pixart": 256, "video": UNET_IMAGE_SIZE}
#: The denoising steps a pipeline is drawn with by default where they differ from the command line's usual count
#: (``paradiff.loading.DEFAULT_STEPS``, which the pictures take). The video model follows held-out prompts nearly
#: as well at 8 steps as at 20 (docs/builtin-models.md), and a clip costs 16 frames of work a step.
OWN_STEPS = {"video": 8}


def pipeline_folder(kind: str) -> Path:
    """The folder ``from_pretrained`` loads the built-in ``kind`` pipeline from."""
    if kind not in PIPELINES:
        raise ParadiffError(f"unknown built-in pipeline {kind!r}; use one of {', '.join(PIPELINES)}")
    folder = WEIGHTS / kind
    if not (folder / "model_index.json").is_file():
        raise ParadiffError(
            f"the built-in weights are missing from {folder}; reinstall paradiff or rebuild them with "
            f"`python -m paradiff.builtin.{'motion_train' if kind == 'video' else 'train'}`"
        )
    return folder


def call_kwargs(kind: str, prompt: str, warn: bool = True) -> dict:
    """The keyword arguments that make the built-in ``kind`` pipeline draw ``prompt`` as intended.

    The prompt at the built-in guidance (:data:`GUIDANCE_SCALE`); for PixArt also
    ``use_resolution_binning=False``, so it draws at the asked size (the pipeline's default draws at
    the nearest size of its table for 256 px models, i.e. 256 px, and resizes the picture) and
    ``clean_caption=False`` (PixArt's default cleaning needs ``bs4`` and ``ftfy`` and would only warn without them,
    once per call). With ``warn``, words the model does not know are warned about
    (:func:`warn_unknown_words`, rank 0 only).
    """
    if kind not in PIPELINES:
        raise ParadiffError(f"unknown built-in pipeline {kind!r}; use one of {', '.join(PIPELINES)}")
    if warn:
        warn_unknown_words(prompt, stacklevel=3, kind=kind)
    kwargs = {"prompt": prompt, "guidance_scale": GUIDANCE_SCALE[kind]}
    if kind == "pixart":
        kwargs |= {"use_resolution_binning": False, "clean_caption": False}
    return kwargs
