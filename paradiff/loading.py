"""Which pipeline a ``--model`` name means, how to load it, and how to prompt it.

* ``paradiff-tiny`` (SD-style U-Net) and ``paradiff-tiny-dit`` (PixArt-style DiT): the trained
  built-in pipelines shipped inside the package (:mod:`paradiff.builtin`), loaded with
  ``from_pretrained`` on their folder, offline.
* ``random-sd`` and ``random-pixart``: benchmark-sized pipelines with random weights built from
  configs (:mod:`paradiff.tiny`); they have no text encoder, so the prompt only seeds their
  conditioning embeddings.
* anything else: a local pipeline folder or a hub id, through ``DiffusionPipeline.from_pretrained``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import ParadiffError

TRAINED_MODELS = {"paradiff-tiny": "sd", "paradiff-tiny-dit": "pixart"}
RANDOM_MODELS = {"random-sd": "sd", "random-pixart": "pixart"}
DEFAULT_MODEL = "paradiff-tiny"
MODEL_NAMES = (*TRAINED_MODELS, *RANDOM_MODELS)


def check_model(model: str) -> None:
    """Reject a ``--model`` that is neither a known name, a local folder nor a hub id (owner/name)."""
    if model in MODEL_NAMES or Path(model).is_dir() or model.count("/") == 1:
        return
    raise ParadiffError(
        f"unknown model {model!r}; pass a local pipeline folder, a hub id (owner/name), "
        f"or one of {', '.join(MODEL_NAMES)}"
    )


def load_pipeline(model: str):
    """The pipeline ``model`` names (see the module docstring), on the CPU in float32."""
    if model in RANDOM_MODELS:
        from .tiny import build_pipeline

        return build_pipeline(RANDOM_MODELS[model], size="bench")
    if model in TRAINED_MODELS:
        from .builtin import pipeline_folder

        model = str(pipeline_folder(TRAINED_MODELS[model]))
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(model, **_absent_components(model))
    except (OSError, ValueError) as error:
        raise ParadiffError(
            f"cannot load model {model!r} ({error}); pass a local pipeline folder, a hub id, "
            f"or one of {', '.join(MODEL_NAMES)}"
        ) from error


def prompt_kwargs(pipe, model: str, prompt: str) -> dict:
    """The keyword arguments that make ``pipe`` draw ``prompt`` (for the built-in models, at their guidance)."""
    if model in TRAINED_MODELS:
        from .builtin import GUIDANCE_SCALE

        return {"prompt": prompt, "guidance_scale": GUIDANCE_SCALE[TRAINED_MODELS[model]]}
    if model not in RANDOM_MODELS:
        return {"prompt": prompt}
    from .tiny import prompt_inputs

    prompt_seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
    return prompt_inputs(pipe, RANDOM_MODELS[model], seed=prompt_seed)


def _absent_components(model: str) -> dict:
    """Components a local pipeline folder saved as absent (``[null, null]``): passed as None to load."""
    index = Path(model) / "model_index.json"
    if not index.is_file():
        return {}
    entries = json.loads(index.read_text())
    return {name: None for name, value in entries.items() if isinstance(value, list) and value[0] is None}
