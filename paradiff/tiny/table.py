"""The table of every tiny pipeline, and the build that runs an entry of it.

An entry says what a name builds (its kind and the function that builds the pipeline; the builder's module is its
group) and how to call it (the function that makes its call arguments). :func:`build` runs the builder under
``torch.manual_seed(seed)``, with the caller's global RNG state saved and restored, so every process that builds a
name with the same seed holds bit-identical weights; the call's prompt embeddings come from a generator seeded with
the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from . import classic, forcing, image_dits, videos, with_text
from .parts import finish, run_options, seeded

KINDS = ("image", "video")


@dataclass(frozen=True)
class Tiny:
    """One tiny pipeline: what it makes, how it is built and how it is called."""

    #: "image" or "video": what the pipeline returns.
    kind: str
    #: Builds the pipeline from the global RNG (keyword options override its defaults).
    pipeline: Callable[..., DiffusionPipeline]
    #: ``call(pipe, generator)``: the arguments of a call, besides :func:`~paradiff.tiny.parts.run_options`.
    call: Callable[[DiffusionPipeline, torch.Generator], dict]

    @property
    def group(self) -> str:
        """The module of :mod:`paradiff.tiny` that builds it: classic, image_dits, videos, with_text or forcing."""
        builder = self.pipeline.func if isinstance(self.pipeline, partial) else self.pipeline
        return builder.__module__.rsplit(".", 1)[-1]


def _classic(family: str, size: str) -> Tiny:
    return Tiny("image", partial(classic.pipeline, family, size), partial(classic.call, family))


TABLE: dict[str, Tiny] = {
    # SD, SDXL, PixArt-Sigma, SD3 and Flux at "tiny" (sd, ...) and "bench" (sd-bench, ...) size
    **{
        classic.table_name(family, size): _classic(family, size)
        for size in classic.SIZES
        for family in classic.FAMILIES
    },
    # one image DiT per family (tests/test_families.py runs these and the videos under every strategy)
    "sana": Tiny("image", image_dits.sana, image_dits.sana_call),
    "hunyuandit": Tiny("image", image_dits.hunyuandit, image_dits.hunyuandit_call),
    "lumina2": Tiny("image", image_dits.lumina2, image_dits.lumina2_call),
    "auraflow": Tiny("image", image_dits.auraflow, image_dits.auraflow_call),
    "cogview4": Tiny("image", image_dits.cogview4, image_dits.cogview4_call),
    "qwenimage": Tiny("image", image_dits.qwenimage, image_dits.qwenimage_call),
    "chroma": Tiny("image", image_dits.chroma, image_dits.chroma_call),
    "flux2": Tiny("image", image_dits.flux2, image_dits.flux2_call),
    # one video pipeline per family
    "wan": Tiny("video", videos.wan, videos.wan_call),
    "cogvideox": Tiny("video", videos.cogvideox, videos.cogvideox_call),
    "hunyuanvideo": Tiny("video", videos.hunyuanvideo, videos.hunyuanvideo_call),
    "ltx": Tiny("video", videos.ltx, videos.ltx_call),
    "mochi": Tiny("video", videos.mochi, videos.mochi_call),
    "latte": Tiny("video", videos.latte, videos.latte_call),
    "allegro": Tiny("video", videos.allegro, videos.allegro_call),
    "animatediff": Tiny("video", videos.animatediff, videos.animatediff_call),
    "svd": Tiny("video", videos.svd, videos.svd_call),
    # CogVideoX with its text encoder and tokenizer: a saved folder of it loads as a user's model would
    "cogvideox-text": Tiny("video", with_text.cogvideox, with_text.cogvideox_call),
    # SkyReels-V2 diffusion forcing (frame blocks at several noise levels), for dualparal; option layers=N
    "skyreels-df": Tiny("video", forcing.pipeline, forcing.call),
}


def names(kind: str | None = None, group: str | None = None) -> tuple[str, ...]:
    """The table's names, in its order: all, or those of one ``kind`` and/or ``group``."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; the kinds are {', '.join(KINDS)}")
    groups = {entry.group for entry in TABLE.values()}
    if group is not None and group not in groups:
        raise ValueError(f"unknown group {group!r}; the groups are {', '.join(sorted(groups))}")
    return tuple(name for name, entry in TABLE.items() if kind in (None, entry.kind) and group in (None, entry.group))


def entry(name: str) -> Tiny:
    """The table's entry ``name``, or an error that lists the names."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(f"unknown tiny pipeline {name!r}; the table holds {', '.join(TABLE)}") from None


def pipeline(name: str, seed: int = 0, **options) -> DiffusionPipeline:
    """The pipeline ``name`` with weights drawn under ``seed``: on CPU, float32, eval mode, no progress bar."""
    build_it = entry(name).pipeline
    with seeded(seed):  # a pipeline's own __init__ may draw too (AnimateDiff builds its UNetMotionModel there)
        pipe = build_it(**options)
    return finish(pipe)


def build(name: str, seed: int = 0, **options) -> tuple[DiffusionPipeline, dict]:
    """``(pipe, call_kwargs)``: ``pipe(**call_kwargs)`` runs the whole pipeline offline on CPU in about a second.

    The call draws its prompt embeddings from a generator seeded with ``seed``, its initial noise from seed 0, runs
    3 steps and returns latents; its generator is consumed by a call: build the arguments again (or replace
    ``generator``) for a second call. ``options`` go to the entry's builder.
    """
    pipe = pipeline(name, seed, **options)
    return pipe, {**run_options(), **entry(name).call(pipe, torch.Generator().manual_seed(seed))}


def save(name: str, folder: str | Path, seed: int = 0, **options) -> Path:
    """The pipeline ``name`` saved as a diffusers pipeline folder, which ``from_pretrained`` loads."""
    pipeline(name, seed, **options).save_pretrained(folder)
    return Path(folder)


def build_pipeline(family: str, size: str = "tiny", seed: int = 0, scheduler: str | None = None) -> DiffusionPipeline:
    """A classic family's pipeline (``classic.FAMILIES``) at ``size`` with random weights seeded by ``seed``.

    The pipeline is on CPU in float32 with the progress bar disabled and has no text encoders or
    tokenizers; call it with ``pipe(**prompt_inputs(pipe, family), ...)``.
    """
    classic.check_family(family)
    classic.check_size(size)
    return pipeline(classic.table_name(family, size), seed, scheduler=scheduler)
