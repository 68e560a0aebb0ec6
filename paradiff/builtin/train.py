"""Train ``paradiff-tiny`` from scratch on generated scenes, on the CPU.

    python -m paradiff.builtin.train                 # ~70 min on 2 cores; writes paradiff/builtin/paradiff-tiny
    python -m paradiff.builtin.train --scale 0.01 --out /tmp/tiny   # a quick smoke run
    python -m paradiff.builtin.train --encoders paradiff/builtin/paradiff-tiny/sd --out /tmp/tiny  # denoisers only

Stages, each seeded:
1. the VAE, on freshly drawn scenes (L1 + MSE + a small KL term): half of each batch 128 px crops around
   the shapes of 256 px scenes (the DiT's size), half whole 128 px scenes (the U-Net's); it then logs its
   round-trip error on held-out scenes at both sizes;
2. a fixed set of scenes (plus their mirror images, with "left" and "right" swapped in the caption)
   is encoded once to latents, at 256 px for the DiT and 128 px for the U-Net, and the VAE's scaling
   factor is set from their spread;
3. the text encoder alone, on the captions: its pooled output must name the words of the caption
   (see ``train_text_encoder``); it is frozen from then on;
4. with ``--decoder-tune N``, the VAE's decoder alone, N steps more (:func:`tune_decoder`): the encoder, and so the
   latents, stay as they are;
5. the U-Net, predicting v (see ``components.NOISE_SCHEDULE``), 10% of the captions dropped to the
   empty prompt for classifier-free guidance;
6. the DiT, on the same data.
Then both pipelines are written (weights of the diffusers models in float16 to stay small; diffusers
loads them as float32 unless told otherwise), the shared components once, linked from ``pixart/``.

``--hold-out`` leaves the scenes that show a shape of ``scenes.HELD_OUT_PROMPTS`` out of the data, so the follow
measure's rates are on prompts the model never saw; ``--encoders DIR --denoisers dit`` trains the DiT alone on an
earlier run's VAE and text encoder; ``--checkpoints DIR`` saves the denoisers' stages' state every
:data:`CHECKPOINT_EVERY` steps and resumes from it, ending with the weights of an unbroken run; ``--dit-patch 2`` and
``--dit-steps N`` train a DiT of 2x2-latent patches (four times the tokens) for N steps, ``--dit-width W`` one W wide;
``--dit-tune N`` then tunes it N steps, mostly at high noise and with the loss weighted up where the kind shows
(:func:`tune`), and ``--unet-tune N`` the U-Net; ``--shape-weight W`` has those stages also count the loss W times more
where the shape's colour shows; ``--encoders DIR --denoisers --decoder-tune N`` tunes the decoder of DIR's VAE alone;
``--tune-from MODEL`` starts the tuning stages from a written model's denoisers (trained on ``--encoders``) instead of
training them first.

Bit-identical weights need the same torch version and thread count (``--threads``, default 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    ModelMixin,
    PixArtAlphaPipeline,
    PixArtTransformer2DModel,
    StableDiffusionPipeline,
)
from diffusers.utils import logging as diffusers_logging
from transformers import CLIPTextModel

from ..errors import ParadiffError
from . import WEIGHTS
from .configs import (
    DIT_WIDTH,
    IMAGE_SIZE,
    NOISE_SCHEDULE,
    PROMPT_TOKENS,
    UNET_IMAGE_SIZE,
    build_dit,
    build_scheduler,
    build_text_encoder,
    build_tokenizer,
    build_unet,
    build_vae,
    dit_heads,
)
from .scenes import PLACES, Scene, make_scenes, shows_held_out

#: Optimizer steps (batch size) of each stage at ``--scale 1``, and the VAE's peak learning rate.
VAE_STEPS, VAE_BATCH, VAE_CROP, VAE_LR = 2000, 8, 128, 1e-3
#: ``--vae-contrast``'s margin: how far, in the batch's latent standard deviations, a shape's latents must lie from
#: those of its bare background.
VAE_CONTRAST_MARGIN = 2.0
DATASET_SCENES = 2500
TEXT_STEPS, TEXT_BATCH = 600, 64
UNET_STEPS, DIT_STEPS, DENOISER_BATCH = 2400, 6000, 16
UNET_LR, DIT_LR = 1e-3, 1e-3
#: The denoisers' tuning stage (``--dit-tune``, ``--unet-tune``): its peak learning rate, the share of each batch
#: whose timestep is drawn from :data:`TUNE_HIGH_FROM` up, and the decay of the moving average of the weights that
#: it writes. The video model's high-noise stage has its own share, floor and draw: each keeps the weights it made.
TUNE_LR, TUNE_HIGH_SHARE, TUNE_HIGH_FROM, EMA_DECAY = 5e-4, 0.5, 500, 0.999
#: A tuning stage started from a written model's denoisers (``--tune-from``): its peak learning rate as a share of
#: :data:`TUNE_LR` (a finished tuning's last steps ran at 0.10-0.16 of it; a whole one would undo them), and the seed
#: offset of its batches (a stage of its own: the first tuning's offsets would replay that stage's batches).
RETUNE_LR_SHARE, RETUNE_SEED = 0.3, 31
#: How many times more the tuning stage's loss counts a latent wholly inside a scene's kind region
#: (:meth:`~paradiff.builtin.scenes.Scene.kind_region`) than one outside it.
KIND_WEIGHT = 10.0
#: The decoder's tuning stage (``--decoder-tune``): its peak learning rate, how many times more its loss counts the
#: pixels on and within two pixels of where a shape of any kind would lie, and the largest spread of the noise added
#: to its latents (of the scaled latents' unit spread).
DECODER_LR, DECODER_SHAPE_WEIGHT, DECODER_LATENT_NOISE = 5e-4, 4.0, 0.4
#: Steps between the saved states a stopped denoiser stage resumes from (``--checkpoints``); its last step is saved too.
CHECKPOINT_EVERY = 250
#: The torch threads a run computes with (``--threads``): bit-identical weights need the same count.
THREADS = 2
CAPTION_DROPOUT = 0.1
SHARED_COMPONENTS = ("vae", "text_encoder", "tokenizer")
DENOISERS = ("unet", "dit")


def parse_loss_weight(text: str) -> float:
    """``--shape-weight``'s (or ``--vae-contrast``'s) value: a loss weight, so 0 (no extra weight) or more."""
    try:
        weight = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no number; give one, e.g. 5") from None
    if not weight >= 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0; give 0 (no extra weight) or more, e.g. 5")
    return weight


def parse_dit_width(text: str) -> int:
    """``--dit-width``'s value: a whole number of the DiT's heads (:func:`~paradiff.builtin.configs.dit_heads`)."""
    try:
        width = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no number; give one, e.g. {2 * DIT_WIDTH}") from None
    try:
        dit_heads(width)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return width


def log(message: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {message}", flush=True)


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Resumable:
    """A training stage's state on disk every :data:`CHECKPOINT_EVERY` steps, so a stopped run goes on where it
    stopped and ends with the weights an unbroken run would have: its modules, the optimizer, the step and the
    batches' random generator."""

    def __init__(self, path: Path, modules: dict[str, torch.nn.Module], generator: torch.Generator):
        self.path, self.modules, self.generator = path, modules, generator

    def restore(self, optimizer: torch.optim.Optimizer) -> int:
        """The step to go on from (0 without a saved state), after loading the saved state."""
        if not self.path.is_file():
            return 0
        state = torch.load(self.path, weights_only=False)
        for name, module in self.modules.items():
            module.load_state_dict(state[name])
        optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        log(f"resumed from {self.path} at step {state['step']}")
        return state["step"]

    def save(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        state = {name: module.state_dict() for name, module in self.modules.items()}
        state |= {"optimizer": optimizer.state_dict(), "generator": self.generator.get_state(), "step": step}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.path.with_suffix(".tmp"))
        self.path.with_suffix(".tmp").replace(self.path)


def optimise(
    params,
    steps: int,
    peak_lr: float,
    loss_at: Callable[[int], torch.Tensor],
    name: str,
    resumable: Resumable | None = None,
    average: torch.nn.Module | None = None,
) -> None:
    """AdamW on ``params`` for ``steps`` steps (:func:`lr_at`); with ``average`` (a module of the same parameters), a
    moving average of them (decay :data:`EMA_DECAY`) is kept in it after every step."""
    params = list(params)
    trained = [p.requires_grad for p in params]
    params = [p for p, kept in zip(params, trained, strict=True) if kept]
    if average is not None:
        averaged = [k for k, kept in zip(average.parameters(), trained, strict=True) if kept]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.01)
    first = resumable.restore(optimizer) if resumable else 0
    start, running = time.perf_counter(), None
    for step in range(first, steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if average is not None:
            with torch.no_grad():
                for kept, param in zip(averaged, params, strict=True):
                    kept.lerp_(param, 1 - EMA_DECAY)
        if resumable and ((step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == steps):
            resumable.save(step + 1, optimizer)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"{name} step {step + 1}/{steps} loss {running:.4f} ({time.perf_counter() - start:.0f} s)")


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float (B, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1


#: One picture of a VAE batch: a scene, the size it is drawn at, and the window of it that is kept.
View = tuple[Scene, int, tuple[slice, slice]]


def crop_window(scene: Scene, rng: random.Random) -> tuple[slice, slice]:
    """A ``VAE_CROP`` square of a DiT-sized scene around one of its shapes, so every crop has colour to learn."""
    shape = rng.choice(scene.shapes)
    cx, cy = (round(f * IMAGE_SIZE) + rng.randint(-VAE_CROP // 4, VAE_CROP // 4) for f in PLACES[shape.place])
    left = min(max(cx - VAE_CROP // 2, 0), IMAGE_SIZE - VAE_CROP)
    top = min(max(cy - VAE_CROP // 2, 0), IMAGE_SIZE - VAE_CROP)
    return slice(top, top + VAE_CROP), slice(left, left + VAE_CROP)


def vae_views(rng: random.Random) -> list[View]:
    """Half crops of DiT-sized scenes, half whole U-Net-sized scenes: both denoisers' data, at one input size."""
    scenes = make_scenes(VAE_BATCH, rng.randrange(2**31))
    half = VAE_BATCH // 2
    crops = [(scene, IMAGE_SIZE, crop_window(scene, rng)) for scene in scenes[:half]]
    return crops + [(scene, UNET_IMAGE_SIZE, (slice(None), slice(None))) for scene in scenes[half:]]


def view_pixels(views: list[View]) -> torch.Tensor:
    return to_pixels(np.stack([scene.draw(size)[window] for scene, size, window in views]))


def view_shape_regions(views: list[View]) -> torch.Tensor:
    """Each view's shape region (:meth:`~paradiff.builtin.scenes.Scene.shape_region`), as float ``(B, 1, H, W)``."""
    regions = np.stack([scene.shape_region(size)[window] for scene, size, window in views])
    return torch.from_numpy(regions).float()[:, None]


def contrast_shortfall(views: list[View], means: torch.Tensor, margin: float = VAE_CONTRAST_MARGIN) -> torch.Tensor:
    """The mean squared shortfall of each one-shape view's contrast below ``margin``: the distance between its latent
    means inside its shape and on its bare background, in the batch's latent standard deviations (0 when every view
    clears the margin, or none has one shape with both regions in view)."""
    regions = F.adaptive_avg_pool2d(view_shape_regions(views), means.shape[-2:])[:, 0]
    spread = means.std().detach()
    shortfalls = []
    for (scene, _, _), latents, region in zip(views, means, regions, strict=True):
        inside, bare = region > 0.95, region < 0.01
        if len(scene.shapes) == 1 and inside.any() and bare.any():
            gap = (latents[:, inside].mean(1) - latents[:, bare].mean(1)).norm() / spread
            shortfalls.append(F.relu(margin - gap) ** 2)
    return torch.stack(shortfalls).mean() if shortfalls else means.new_zeros(())


def train_vae(vae, steps: int, seed: int, contrast: float = 0.0, peak_lr: float = VAE_LR) -> None:
    """The VAE; with ``contrast``, the loss also counts :func:`contrast_shortfall` that many times.

    Trained on reconstruction alone, it put some shape colours' latents next to their background's (yellow on white,
    purple on gray, green on black), and a denoiser's loss, which counts an error by the square of that distance,
    then learns those outlines last (``benchmarks/latent_contrast.py``)."""
    rng = random.Random(seed)

    def loss_at(step: int) -> torch.Tensor:
        views = vae_views(rng)
        pixels = view_pixels(views)
        posterior = vae.encode(pixels).latent_dist
        recon = vae.decode(posterior.sample()).sample
        kl = posterior.kl().mean() / pixels[0].numel()
        loss = F.l1_loss(recon, pixels) + F.mse_loss(recon, pixels) + 1e-4 * kl
        return loss + contrast * contrast_shortfall(views, posterior.mean) if contrast else loss

    optimise(vae.parameters(), steps, peak_lr, loss_at, "vae")


def scale_to_unit_spread(vae, latents: torch.Tensor) -> None:
    """The VAE's scaling factor from its unscaled ``latents``: the denoisers learn on latents of unit spread, as
    the noise they are mixed with has."""
    vae.register_to_config(scaling_factor=float(1 / latents.std()))


def tune_decoder(vae, steps: int, seed: int) -> None:
    """The VAE's decoder alone, further: the encoder, and so the latents the denoisers learn from, stay as they are.

    The VAE's own stage leaves small shapes at 128 px (a small triangle spans three latents) with a rim in a
    neighbouring colour (blue into purple, yellow into orange) and rounded corners, which its even loss over a mostly
    bare picture barely counts: here the loss counts the shapes and their edges :data:`DECODER_SHAPE_WEIGHT` times
    more. A denoiser's latents are not exactly an encoder's either, so the decoder also learns to draw flat shapes
    from latents with noise added (a spread drawn up to :data:`DECODER_LATENT_NOISE` per picture)."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    vae.requires_grad_(False)
    decoder = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    for parameter in decoder:
        parameter.requires_grad_(True)
    unit = 1 / vae.config.scaling_factor

    def loss_at(step: int) -> torch.Tensor:
        views = vae_views(rng)
        pixels = view_pixels(views)
        weights = 1 + DECODER_SHAPE_WEIGHT * F.max_pool2d(view_shape_regions(views), 5, stride=1, padding=2)
        with torch.no_grad():
            latents = vae.encode(pixels).latent_dist.mean
            spread = DECODER_LATENT_NOISE * unit * torch.rand(len(latents), 1, 1, 1, generator=generator)
            latents = latents + spread * torch.randn(latents.shape, generator=generator)
        error = vae.decode(latents).sample - pixels
        return ((error.abs() + error**2) * weights).mean() / weights.mean()

    optimise(decoder, steps, DECODER_LR, loss_at, "decoder")
    vae.requires_grad_(False)


@torch.no_grad()
def log_round_trip_error(vae, seed: int, count: int = 32) -> None:
    """Mean absolute error (of 255) of encoding and decoding held-out scenes; colours shift once it passes ~3."""
    scenes = make_scenes(count, seed)
    for size in (UNET_IMAGE_SIZE, IMAGE_SIZE):
        pixels = to_pixels(np.stack([scene.draw(size) for scene in scenes]))
        recon = torch.cat([vae.decode(vae.encode(chunk).latent_dist.mean).sample for chunk in pixels.split(8)])
        error = (recon.clamp(-1, 1) - pixels).abs().mean() * 127.5
        log(f"vae round trip at {size} px: mean absolute error {error:.2f}/255")


def mirrored(scene: Scene) -> str:
    """The caption of the scene's mirror image."""
    swap = {"left": "right", "right": "left"}
    return " ".join(swap.get(word, word) for word in scene.caption.split())


@torch.no_grad()
def encode_dataset(
    vae, count: int, seed: int, size: int, hold_out: bool = False, shape_share: float = 0.0
) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """Latents (unscaled means), captions and kind maps of ``count`` scenes and their mirror images, drawn at
    ``size`` px; with ``hold_out``, less those that show a held-out prompt's shape
    (:func:`~paradiff.builtin.scenes.shows_held_out`). A kind map is the share of each latent's pixels that lie in
    the scene's kind region (:meth:`~paradiff.builtin.scenes.Scene.kind_region`), plus ``shape_share`` times the
    share in its shape region (:meth:`~paradiff.builtin.scenes.Scene.shape_region`), shaped ``(1, h, w)``.
    """
    scenes = make_scenes(count, seed)
    latents, captions, maps = [], [], []
    for first in range(0, count, 32):
        batch = scenes[first : first + 32]
        pixels = to_pixels(np.stack([scene.draw(size) for scene in batch]))
        means = vae.encode(torch.cat([pixels, pixels.flip(-1)])).latent_dist.mean
        regions = np.stack([tuning_region(scene, size, shape_share) for scene in batch])[:, None]
        regions = torch.from_numpy(regions).float()
        regions = F.adaptive_avg_pool2d(regions, means.shape[-2:])
        latents.append(means)
        maps.append(torch.cat([regions, regions.flip(-1)]))
        captions += [scene.caption for scene in batch] + [mirrored(scene) for scene in batch]
    if not hold_out:
        log(f"encoded {len(captions)} scenes")
        return torch.cat(latents), captions, torch.cat(maps)
    kept = [index for index, caption in enumerate(captions) if not shows_held_out(caption)]
    log(f"encoded {len(captions)} scenes, kept {len(kept)} (the others show a held-out prompt's shape)")
    return torch.cat(latents)[kept], [captions[index] for index in kept], torch.cat(maps)[kept]


def tuning_region(scene: Scene, size: int, shape_share: float) -> np.ndarray:
    """The scene's kind region, plus ``shape_share`` on its shape region, as float32 pixels."""
    return scene.kind_region(size).astype(np.float32) + shape_share * scene.shape_region(size).astype(np.float32)


def token_ids(tokenizer, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = tokenizer(captions, padding="max_length", max_length=PROMPT_TOKENS, truncation=True, return_tensors="pt")
    return tokens.input_ids, tokens.attention_mask


def denoiser_batches(
    latents, captions, tokenizer, generator: torch.Generator, high_noise: bool = False, kind_maps=None
) -> Iterator[tuple]:
    """Endless batches of (noisy latents, v targets, timesteps, token ids, attention masks, loss weights), drawn by
    ``generator``; with ``high_noise``, about :data:`TUNE_HIGH_SHARE` of each batch has its timestep drawn from
    :data:`TUNE_HIGH_FROM` up. The loss weights are None (an even loss), or with ``kind_maps`` (one per latent,
    see :func:`encode_dataset`) 1 plus :data:`KIND_WEIGHT` times each drawn latent's map."""
    noise_schedule = DDPMScheduler(**NOISE_SCHEDULE)
    while True:
        index = torch.randint(len(captions), (DENOISER_BATCH,), generator=generator)
        drop = torch.rand(DENOISER_BATCH, generator=generator) < CAPTION_DROPOUT
        kept = zip(index.tolist(), drop.tolist(), strict=True)
        batch_captions = ["" if dropped else captions[i] for i, dropped in kept]
        clean = latents[index]
        noise = torch.randn(clean.shape, generator=generator)
        levels = NOISE_SCHEDULE["num_train_timesteps"]
        if high_noise:
            uniform = torch.rand(DENOISER_BATCH, generator=generator)
            high = torch.rand(DENOISER_BATCH, generator=generator) < TUNE_HIGH_SHARE
            lowest = torch.where(high, TUNE_HIGH_FROM, 0)
            timesteps = (lowest + uniform * (levels - lowest)).long().clamp(max=levels - 1)
        else:
            timesteps = torch.randint(levels, (DENOISER_BATCH,), generator=generator)
        noisy = noise_schedule.add_noise(clean, noise, timesteps)
        target = noise_schedule.get_velocity(clean, noise, timesteps)
        ids, mask = token_ids(tokenizer, batch_captions)
        weights = None if kind_maps is None else 1 + KIND_WEIGHT * kind_maps[index]
        yield noisy, target, timesteps, ids, mask, weights


def weighted_mse(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The mean squared error with each element counted by ``weights`` (broadcast), over their mean weight, so that
    a weighted loss reads on the scale of the even one; None: the even mean."""
    if weights is None:
        return F.mse_loss(prediction, target)
    weights = weights.expand_as(prediction)
    return ((prediction - target) ** 2 * weights).mean() / weights.mean()


def train_text_encoder(
    text_encoder,
    tokenizer,
    captions: list[str],
    steps: int,
    seed: int,
) -> None:
    """Teach the text encoder to say which words a caption holds, in the mean of its outputs; then freeze it.

    Cross-attention starts out spreading its weight evenly over the prompt's tokens, so at first a
    denoiser reads the mean of the text encoder's outputs (and the U-Net's pooled caption embedding
    reads it too). A random encoder buries the few place words in that mean, and one trained together
    with the U-Net had made "top left" and "bottom right" nearly the same vectors, so the denoisers
    never learned where to draw. Here a linear head must read every word of the caption (multi-label,
    over the vocabulary) from both means the pipelines produce: over all padded positions without a
    mask, as the SD pipeline calls the encoder, and over the caption's tokens with the mask, as PixArt
    does. The head is then dropped.
    """
    captions = sorted(set(captions))
    ids, mask = token_ids(tokenizer, captions)
    words = torch.zeros(len(captions), len(tokenizer)).scatter_(1, ids, 1.0)
    words[:, tokenizer.all_special_ids] = 0
    width = text_encoder.config.hidden_size
    head = torch.nn.Linear(width, len(tokenizer))
    generator = torch.Generator().manual_seed(seed)

    def loss_at(step: int) -> torch.Tensor:
        index = torch.randint(len(captions), (TEXT_BATCH,), generator=generator)
        unmasked = text_encoder(ids[index])[0].mean(1)
        weights = mask[index, :, None].float()
        masked = (text_encoder(ids[index], attention_mask=mask[index])[0] * weights).sum(1) / weights.sum(1)
        return sum(F.binary_cross_entropy_with_logits(head(pooled), words[index]) for pooled in (unmasked, masked))

    optimise([*text_encoder.parameters(), *head.parameters()], steps, 3e-3, loss_at, "text encoder")
    text_encoder.requires_grad_(False)


def train_unet(
    unet,
    text_encoder,
    batches,
    steps: int,
    resumable: Resumable | None = None,
    peak_lr: float = UNET_LR,
    average: torch.nn.Module | None = None,
) -> None:
    """The U-Net; the text encoder sees no attention mask, as in the SD pipeline (``average``: see
    :func:`optimise`)."""

    def loss_at(step: int) -> torch.Tensor:
        noisy, target, timesteps, ids, _, weights = next(batches)
        with torch.no_grad():
            text = text_encoder(ids)[0]
        prediction = unet(noisy, timesteps, encoder_hidden_states=text).sample
        return weighted_mse(prediction, target, weights)

    name = "unet" if average is None else "unet tuning"
    optimise(unet.parameters(), steps, peak_lr, loss_at, name, resumable, average)


def train_dit(
    dit,
    text_encoder,
    batches,
    steps: int,
    resumable: Resumable | None = None,
    peak_lr: float = DIT_LR,
    average: torch.nn.Module | None = None,
) -> None:
    """The DiT; masks as the PixArt pipeline passes them (``average``: see :func:`optimise`)."""
    no_extra_conditions = {"resolution": None, "aspect_ratio": None}

    def loss_at(step: int) -> torch.Tensor:
        noisy, target, timesteps, ids, mask, weights = next(batches)
        with torch.no_grad():
            text = text_encoder(ids, attention_mask=mask)[0]
        prediction = dit(
            noisy,
            encoder_hidden_states=text,
            encoder_attention_mask=mask,
            timestep=timesteps,
            added_cond_kwargs=no_extra_conditions,
        ).sample
        return weighted_mse(prediction, target, weights)

    optimise(dit.parameters(), steps, peak_lr, loss_at, "dit" if average is None else "dit tuning", resumable, average)


def tune(
    name: str,
    denoiser,
    trainer: Callable,
    text_encoder,
    batches,
    generator: torch.Generator,
    steps: int,
    checkpoints: Path | None,
    retune: bool = False,
) -> torch.nn.Module:
    """The trained denoiser ``name`` (``trainer``: :func:`train_dit` or :func:`train_unet`) further, at half the
    learning rate with half of each batch at high noise and the loss weighted up on the kind region (``batches``
    from :func:`denoiser_batches` with both), and the moving average of its weights over that run (the denoiser
    this returns).

    A small denoiser puts the asked colour in the asked place long before it draws the asked kind, and then draws
    every kind as the same blob: replacing the kind word in the caption barely changes its loss at low
    noise, so most of its uniformly drawn steps teach it nothing about kinds; at high noise, where the
    outline is decided, they do. Even there the few latents where a circle, a square and a triangle differ
    are a small share of an even loss, so the loss counts them :data:`KIND_WEIGHT` times (docs/benchmarks.md
    has the figures). The average smooths the steps' noise out of the outline. The asked colour, too, fills a
    small share of most pictures, and one that bleeds into its neighbour (purple into blue) costs an even loss
    little: ``batches`` drawn with a shape share weigh the whole shape up as well (``--shape-weight``).

    ``retune``: ``denoiser`` is a written model's, already tuned (``--tune-from``); the stage runs at
    :data:`RETUNE_LR_SHARE` of the learning rate and saves its state apart from the first tuning's."""
    average = copy.deepcopy(denoiser).requires_grad_(False)
    modules = {name: denoiser, "average": average}
    state = checkpoints / f"{name}-{'retune' if retune else 'tune'}.pt" if checkpoints else None
    resumable = Resumable(state, modules, generator) if state else None
    peak_lr = TUNE_LR * (RETUNE_LR_SHARE if retune else 1.0)
    trainer(denoiser, text_encoder, batches, steps, resumable, peak_lr, average)
    return average


def with_written_weights(built: ModelMixin, folder: Path, hint: str = "give a folder this script wrote") -> ModelMixin:
    """``built`` holding the weights written in ``folder``: its config, unlike a loaded model's, names no folder
    (``_name_or_path``), so what it writes is what a fresh run would write. Weights of another shape (a model built
    from other parts) are refused naming the first that differs and ``hint``, the fix."""
    written, expected = type(built).from_pretrained(folder).state_dict(), built.state_dict()
    for name in sorted(written.keys() | expected.keys()):
        there, here = (tuple(weights[name].shape) if name in weights else "missing" for weights in (written, expected))
        if there != here:
            raise ParadiffError(
                f"{folder} holds another {type(built).__name__} than this run builds: {name} is {there} there, "
                f"{here} here; {hint}"
            )
    built.load_state_dict(written)
    return built


def _save_in_float16(saved, folder: Path) -> None:
    """Write ``saved`` (a pipeline or one model) with its diffusers models' weights in float16, leaving the models in
    float32."""
    components = [saved] if isinstance(saved, ModelMixin) else saved.components.values()
    models = [module for module in components if isinstance(module, ModelMixin)]
    previous = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # casting a loaded model with to() warns; these are fresh
    try:
        for model in models:
            model.to(torch.float16)
        saved.save_pretrained(folder)
    finally:
        for model in models:
            model.to(torch.float32)
        diffusers_logging.set_verbosity(previous)
    log(f"wrote {folder}")


def written_pipeline(folder: Path) -> str | None:
    """The pipeline class a written pipeline ``folder`` holds (its ``model_index.json``'s), or None where it holds
    none: what a script's ``--tune-from`` checks before it runs anything."""
    index = folder / "model_index.json"
    return json.loads(index.read_text()).get("_class_name") if index.is_file() else None


def link_pictures_vae(folder: Path, pictures: Path) -> None:
    """Replace the VAE written in the pipeline ``folder`` by a link to the pictures': ``../sd/vae`` beside it, else
    ``pictures``' own; the video models decode with the pictures' VAE and need no copy."""
    shutil.rmtree(folder / "vae")
    beside = Path("..") / "sd" / "vae"
    target = beside if (folder / beside).is_dir() else (pictures / "sd" / "vae").resolve()
    (folder / "vae").symlink_to(target, target_is_directory=True)


def save_sd(out: Path, tokenizer, text_encoder, vae, unet) -> None:
    if out.exists():
        shutil.rmtree(out)
    pipe = StableDiffusionPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        unet=unet,
        scheduler=build_scheduler("sd"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    _save_in_float16(pipe, out / "sd")


def save_pixart(out: Path, tokenizer, text_encoder, vae, dit) -> None:
    """``pixart/`` links the components it shares with ``sd/`` instead of holding copies."""
    shutil.rmtree(out / "pixart", ignore_errors=True)
    pipe = PixArtAlphaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=dit, scheduler=build_scheduler("pixart")
    )
    _save_in_float16(pipe, out / "pixart")
    for name in SHARED_COMPONENTS:
        shutil.rmtree(out / "pixart" / name)
        (out / "pixart" / name).symlink_to(Path("..") / "sd" / name, target_is_directory=True)


def round_to_float16(module: torch.nn.Module) -> None:
    """Round ``module``'s weights to the float16 values that ship, so the next stages train on exactly those."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(parameter.half().float())


def train(
    out: Path,
    scale: float,
    seed: int,
    encoders: Path | None = None,
    denoisers: tuple[str, ...] = DENOISERS,
    checkpoints: Path | None = None,
    hold_out: bool = False,
    dit_patch: int = 4,
    dit_width: int = DIT_WIDTH,
    dit_steps: int | None = None,
    dit_tune: int = 0,
    unet_tune: int = 0,
    shape_weight: float = 0.0,
    decoder_tune: int = 0,
    tune_from: Path | None = None,
    vae_contrast: float = 0.0,
) -> None:
    """All stages, or with ``encoders`` (an earlier run's ``sd/`` folder) its VAE and text encoder and the
    ``denoisers``; with ``checkpoints`` (a folder) each denoiser's stages save their state there and resume from it;
    with ``hold_out`` the denoisers never see a held-out prompt's shape (see :func:`encode_dataset`). ``dit_patch``,
    ``dit_width`` and ``dit_steps`` (default: the scaled :data:`DIT_STEPS`) change the DiT's patch size, width and
    training steps; a stage resumed with more steps than it was saved under goes on with the longer run's learning rate;
    ``dit_tune`` steps of :func:`tune` follow, and the DiT written is their average; ``unet_tune`` does the same for the
    U-Net; ``shape_weight`` is :func:`tune`'s extra weight on the shape region; ``decoder_tune`` steps of
    :func:`tune_decoder` follow the text encoder (with ``encoders`` and no ``denoisers``, only they run, and the
    encoders' folder is written with the new VAE); with ``tune_from`` (a written model folder, trained on ``encoders``)
    the ``denoisers`` are its own, their training stages do not run, and their tuning stages go on from them
    (``tune(..., retune=True)``); ``vae_contrast`` is :func:`train_vae`'s ``contrast``."""

    def scaled(steps: int) -> int:
        return max(2, round(steps * scale))

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder, vae = build_text_encoder(tokenizer), build_vae()
    if encoders is None:
        torch.manual_seed(seed + 1)
        train_vae(vae, scaled(VAE_STEPS), seed + 1, vae_contrast)
    else:
        vae = with_written_weights(vae, encoders / "vae")
        vae.register_to_config(scaling_factor=AutoencoderKL.load_config(encoders / "vae")["scaling_factor"])
    round_to_float16(vae)
    vae.requires_grad_(False).eval()
    round_trip_scenes = max(1, min(32, round(32 * scale)))  # a log line: one scene will do in a smoke run
    log_round_trip_error(vae, seed + 8, round_trip_scenes)
    count = max(DENOISER_BATCH // 2, round(DATASET_SCENES * scale))  # with their mirrors, a batch at the least
    shape_share = shape_weight / KIND_WEIGHT
    if encoders is None or "dit" in denoisers:  # the DiT's data, which also sets the VAE's scale and the captions
        latents, captions, kind_maps = encode_dataset(vae, count, seed + 2, IMAGE_SIZE, hold_out, shape_share)
    if encoders is None:
        scale_to_unit_spread(vae, latents)
        torch.manual_seed(seed + 5)
        train_text_encoder(text_encoder, tokenizer, captions, scaled(TEXT_STEPS), seed + 5)
    else:
        text_encoder = CLIPTextModel.from_pretrained(encoders / "text_encoder").requires_grad_(False)
    round_to_float16(text_encoder)
    text_encoder.eval()
    if decoder_tune:
        tune_decoder(vae, decoder_tune, seed + 13)
        round_to_float16(vae)
        log_round_trip_error(vae, seed + 8, round_trip_scenes)

    retune = tune_from is not None
    if "unet" in denoisers:
        small_latents, small_captions, small_maps = encode_dataset(
            vae, count, seed + 2, UNET_IMAGE_SIZE, hold_out, shape_share
        )
        unet_latents = small_latents * vae.config.scaling_factor
        if not retune:
            torch.manual_seed(seed + 6)
            unet = build_unet()
            generator = torch.Generator().manual_seed(seed + 3)
            resumable = Resumable(checkpoints / "unet.pt", {"unet": unet}, generator) if checkpoints else None
            batches = denoiser_batches(unet_latents, small_captions, tokenizer, generator)
            train_unet(unet, text_encoder, batches, scaled(UNET_STEPS), resumable)
        else:
            unet = with_written_weights(build_unet(), tune_from / "sd" / "unet")
        if unet_tune:
            generator = torch.Generator().manual_seed(seed + (RETUNE_SEED if retune else 12))
            batches = denoiser_batches(unet_latents, small_captions, tokenizer, generator, True, small_maps)
            unet = tune("unet", unet, train_unet, text_encoder, batches, generator, unet_tune, checkpoints, retune)
        save_sd(out, tokenizer, text_encoder, vae, unet)
    else:
        if (out / "sd").resolve() != encoders.resolve():
            shutil.rmtree(out / "sd", ignore_errors=True)
            shutil.copytree(encoders, out / "sd")
        if decoder_tune:
            shutil.rmtree(out / "sd" / "vae")
            _save_in_float16(vae, out / "sd" / "vae")
    if "dit" in denoisers:
        dit_latents = latents * vae.config.scaling_factor
        if not retune:
            torch.manual_seed(seed + 7)
            dit = build_dit(dit_patch, dit_width)
            generator = torch.Generator().manual_seed(seed + 4)
            resumable = Resumable(checkpoints / "dit.pt", {"dit": dit}, generator) if checkpoints else None
            batches = denoiser_batches(dit_latents, captions, tokenizer, generator)
            train_dit(dit, text_encoder, batches, scaled(DIT_STEPS) if dit_steps is None else dit_steps, resumable)
        else:
            written = tune_from / "pixart" / "transformer"
            config = PixArtTransformer2DModel.load_config(written)
            width = config["num_attention_heads"] * config["attention_head_dim"]
            dit = with_written_weights(build_dit(config["patch_size"], width), written)
        if dit_tune:
            generator = torch.Generator().manual_seed(seed + (RETUNE_SEED if retune else 11))
            batches = denoiser_batches(dit_latents, captions, tokenizer, generator, True, kind_maps)
            dit = tune("dit", dit, train_dit, text_encoder, batches, generator, dit_tune, checkpoints, retune)
        save_pixart(out, tokenizer, text_encoder, vae, dit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps and data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument(
        "--encoders", type=Path, help="an earlier run's sd/ folder: reuse its VAE and text encoder, train the denoisers"
    )
    parser.add_argument(
        "--denoisers",
        nargs="*",
        choices=DENOISERS,
        default=list(DENOISERS),
        help="with --encoders: train only these (none: with --decoder-tune, the decoder alone)",
    )
    parser.add_argument(
        "--checkpoints", type=Path, help="a folder the denoisers' stages save their state in and resume from"
    )
    parser.add_argument(
        "--hold-out", action="store_true", help="leave the held-out prompts' shapes out of the denoisers' data"
    )
    parser.add_argument("--dit-patch", type=int, choices=(2, 4), default=4, help="the DiT's patch size in latents")
    parser.add_argument(
        "--dit-width",
        type=parse_dit_width,
        help=f"the DiT's width, a whole number of 32-wide heads (default: {DIT_WIDTH})",
    )
    parser.add_argument("--dit-steps", type=int, help=f"the DiT's training steps (default: {DIT_STEPS} x --scale)")
    parser.add_argument(
        "--dit-tune",
        type=int,
        default=0,
        help="then tune the DiT this many steps, mostly at high noise, weighted to the outlines (default: 0)",
    )
    parser.add_argument(
        "--unet-tune",
        type=int,
        default=0,
        help="then tune the U-Net this many steps, as --dit-tune does the DiT (default: 0)",
    )
    parser.add_argument(
        "--shape-weight",
        type=parse_loss_weight,
        default=0.0,
        help="the tuning stages also count the loss this many times more where the shape's colour shows (default: 0)",
    )
    parser.add_argument(
        "--decoder-tune",
        type=int,
        default=0,
        help="after the text encoder, tune the VAE's decoder alone this many steps; the latents stay (default: 0)",
    )
    parser.add_argument(
        "--tune-from",
        type=Path,
        help="a written model folder (trained on --encoders): its denoisers skip their training stage and take "
        "--dit-tune / --unet-tune steps more from its weights, at a lower learning rate",
    )
    parser.add_argument(
        "--vae-contrast",
        type=parse_loss_weight,
        default=0.0,
        help="the VAE's loss also counts this many times how far each shape's latents fall short of lying "
        f"{VAE_CONTRAST_MARGIN:g} latent deviations from its background's (default: 0)",
    )
    args = parser.parse_args(argv)
    if args.encoders is not None and args.vae_contrast:
        parser.error("--vae-contrast weighs the VAE's training, and --encoders reuses a trained VAE; give one of them")
    if args.encoders is None and (tuple(args.denoisers) != DENOISERS or args.tune_from):
        parser.error("--denoisers and --tune-from need --encoders (the VAE and text encoder the denoisers train on)")
    if not args.denoisers and not args.decoder_tune:
        parser.error("no --denoisers and no --decoder-tune: there is nothing to train")
    untuned = [name for name in args.denoisers if not getattr(args, f"{name}_tune")]
    if args.tune_from and untuned:
        parser.error(
            f"--tune-from runs only tuning stages; give --{untuned[0]}-tune N, or leave {untuned[0]} out of --denoisers"
        )
    if args.tune_from and args.dit_width is not None:
        parser.error("--tune-from keeps the written DiT's width; leave out --dit-width")
    if args.tune_from and args.dit_steps is not None:
        parser.error("--tune-from skips the DiT's training stage, so --dit-steps has nothing to count")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        train(
            args.out,
            args.scale,
            args.seed,
            args.encoders,
            tuple(args.denoisers),
            args.checkpoints,
            args.hold_out,
            args.dit_patch,
            DIT_WIDTH if args.dit_width is None else args.dit_width,
            args.dit_steps,
            args.dit_tune,
            args.unet_tune,
            args.shape_weight,
            args.decoder_tune,
            args.tune_from,
            args.vae_contrast,
        )
    except ParadiffError as error:
        parser.error(str(error))
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
