"""The clips (:mod:`paradiff.builtin.clips`) as the video model's training batches: encoded once, drawn forwards and
backwards, noised as the pictures are (``train.denoiser_batches``).

Each clip is also trained played backwards, captioned with the opposite direction: exact, since the VAE encodes
single frames. Half of a batch at high noise (:data:`NOISE_BANDS`) is where the whole clip's layout, and so the way
the shape moves, is decided: without it an earlier model put the shape in the same place in every frame. Half at low
noise is where the edges are drawn: a model given a true small square on gray with only the last steps' noise still
rounded it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler

from .clips import Clip
from .configs import NOISE_SCHEDULE
from .train import CAPTION_DROPOUT, KIND_WEIGHT, log, to_pixels, token_ids

#: Clips drawn and encoded at ``--scale 1`` (twice as many are trained on, with their reversals).
DATASET_CLIPS = 500
#: Clips per batch, and the peak learning rate of the stages that train on them.
VIDEO_BATCH, VIDEO_LR = 4, 5e-4
#: The tuning stage's peak learning rate: it goes on from a trained model.
KIND_TUNE_LR = 0.3 * VIDEO_LR
#: The share of each batch whose timesteps are drawn from one band of :data:`NOISE_BANDS`.
BAND_SHARE = 0.5
#: The bands of timesteps, ``[from, to)``, that a batch can put :data:`BAND_SHARE` of itself in.
NOISE_BANDS = {"high": (700, 1000), "low": (0, 300)}


def encode_clips(vae: AutoencoderKL, clips: list[Clip], size: int) -> torch.Tensor:
    """Scaled latent means of ``clips`` drawn at ``size`` px, ``(N, C, FRAMES, h, w)`` as the video U-Net takes them,
    encoded frame by frame."""
    latents = []
    for index, clip in enumerate(clips):
        means = vae.encode(to_pixels(clip.draw(size))).latent_dist.mean
        latents.append(means.transpose(0, 1) * vae.config.scaling_factor)
        if index % 50 == 0:
            log(f"encoded {index + 1}/{len(clips)} clips")
    return torch.stack(latents)


def kind_maps(clips: list[Clip], size: int, latent_side: int, shape_share: float = 0.0) -> torch.Tensor:
    """Per clip and frame, the share of each latent's pixels in the frame's kind region
    (:meth:`~paradiff.builtin.clips.Clip.kind_regions`), plus ``shape_share`` times the share in its shape region
    (:meth:`~paradiff.builtin.clips.Clip.shape_regions`), ``(N, 1, FRAMES, h, w)`` as the latents."""

    def pooled(clip: Clip) -> torch.Tensor:
        regions = clip.kind_regions(size).astype(np.float32)
        if shape_share:
            regions += shape_share * clip.shape_regions(size).astype(np.float32)
        return F.adaptive_avg_pool2d(torch.from_numpy(regions), latent_side)

    return torch.stack([pooled(clip) for clip in clips])[:, None]


def shape_maps(clips: list[Clip], size: int, latent_side: int) -> torch.Tensor:
    """Per clip and frame, the share of each latent's pixels in the frame's shape region
    (:meth:`~paradiff.builtin.clips.Clip.shape_regions`), ``(N, 1, FRAMES, h, w)`` as the latents."""

    def pooled(clip: Clip) -> torch.Tensor:
        return F.adaptive_avg_pool2d(torch.from_numpy(clip.shape_regions(size).astype(np.float32)), latent_side)

    return torch.stack([pooled(clip) for clip in clips])[:, None]


def as_drawn(per_clip: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``per_clip``'s rows (a clip's latents or maps, frames on dimension 1) for the drawn ``index``: an odd index is
    its clip played backwards."""
    return torch.stack([per_clip[i // 2].flip(1) if i % 2 else per_clip[i // 2] for i in index.tolist()])


def video_batches(
    latents: torch.Tensor,
    clips: list[Clip],
    tokenizer,
    generator: torch.Generator,
    band: str | None = None,
    kind_maps: torch.Tensor | None = None,
    chances: list[float] | None = None,
    shape_maps: torch.Tensor | None = None,
) -> Iterator[tuple]:
    """Endless batches of (noisy latents, v targets, timesteps, token ids, masks, loss weights, shape maps); an odd
    index is a clip reversed. With a ``band`` (a key of :data:`NOISE_BANDS`), :data:`BAND_SHARE` of each batch has
    its timestep drawn from that band. The loss weights are None (an even loss), or with ``kind_maps``
    (:func:`kind_maps`) 1 plus :data:`~paradiff.builtin.train.KIND_WEIGHT` times each drawn clip's map. Clips are
    drawn evenly, or with ``chances`` (one per clip) in proportion to them. The shape maps are None, or with
    ``shape_maps`` (:func:`shape_maps`) each drawn clip's, zero where its caption was dropped (no colour was asked).
    Every draw comes from ``generator``, read only as batches are taken, so a resumed stage restores it first."""
    captions = [caption for clip in clips for caption in (clip.caption, clip.reversed().caption)]
    if chances is not None:
        draw_weights = torch.tensor([chance for chance in chances for _ in range(2)], dtype=torch.float64)
    noise_schedule = DDPMScheduler(**NOISE_SCHEDULE)
    while True:
        if chances is None:
            index = torch.randint(len(captions), (VIDEO_BATCH,), generator=generator)
        else:
            index = torch.multinomial(draw_weights, VIDEO_BATCH, replacement=True, generator=generator)
        drop = torch.rand(VIDEO_BATCH, generator=generator) < CAPTION_DROPOUT
        clean = as_drawn(latents, index)
        noise = torch.randn(clean.shape, generator=generator)
        levels = NOISE_SCHEDULE["num_train_timesteps"]
        timesteps = torch.randint(levels, (VIDEO_BATCH,), generator=generator)
        if band is not None:
            banded = torch.randint(*NOISE_BANDS[band], (VIDEO_BATCH,), generator=generator)
            timesteps = torch.where(torch.arange(VIDEO_BATCH) < BAND_SHARE * VIDEO_BATCH, banded, timesteps)
        noisy = noise_schedule.add_noise(clean, noise, timesteps)
        target = noise_schedule.get_velocity(clean, noise, timesteps)
        kept = zip(index.tolist(), drop.tolist(), strict=True)
        ids, mask = token_ids(tokenizer, ["" if dropped else captions[i] for i, dropped in kept])
        weights = None if kind_maps is None else 1 + KIND_WEIGHT * as_drawn(kind_maps, index)
        shapes = None
        if shape_maps is not None:
            shapes = as_drawn(shape_maps, index)
            shapes[drop] = 0
        yield noisy, target, timesteps, ids, mask, weights, shapes
