"""Train a Latte video model on generated clips, on the CPU, starting from ``paradiff-tiny``'s trained parts.

    python -m paradiff.builtin.video_train --out DIR  # ~3 h on 2 cores; from the shipped pictures, writes DIR/video
    python -m paradiff.builtin.video_train --scale 0.01 --out /tmp/tiny-video   # a quick smoke run
    python -m paradiff.builtin.video_train --resume DIR/video  # stages 4 and 5 only, from a stage 3 output
    python -m paradiff.builtin.video_train --out DIR --checkpoints STATE  # stopped, the same command goes on
    python -m paradiff.builtin.video_train --out DIR --tune-from paradiff-tiny --kind-tune 2400 --shape-weight 5
    python -m paradiff.builtin.video_train --out DIR --tune-from paradiff-tiny --kind-tune 2400 --kind-draw triangle=3

The shipped video model until 2026-12-07 (it is now :mod:`paradiff.builtin.motion_train`'s U-Net with motion
modules, which follows the held-out prompts better) was this script's diffusers ``LattePipeline``: a DiT whose
spatial blocks draw each frame and whose temporal blocks attend across the frames at each position, decoded frame by
frame by the pictures' 2D VAE. It starts from a ``paradiff-tiny`` folder's DiT, VAE and text encoder, so it draws
shapes and colours from the first step and only has to learn how they move: the model shipped until then from the
shipped DiT of 2x2 patches, drawing 256 px frames, its training size: 16x16 tokens each. Stages, each seeded:

1. the tokenizer gains the clips' motion words after the pictures' words ("moving", and one token for each
   direction phrase, :data:`~paradiff.builtin.clips.DIRECTION_TOKENS`), and the text encoder one embedding
   row for each; it is trained further on the pictures' and the clips'
   captions to name their words and, for clips, their direction of travel (``train.train_text_encoder``),
   then frozen;
2. clips (:mod:`paradiff.builtin.clips`) are encoded frame by frame to latents, once; each is also
   used played backwards, captioned with the opposite direction (exact: the VAE sees single frames);
3. the Latte DiT (``components.build_video_dit``) takes the DiT's weights; its temporal blocks start as
   the identity (their output projections zero) and it is trained predicting v, with the pictures'
   noise schedule and 10% of captions dropped, as the DiT was;
4. it is trained further with half of each batch at high noise levels (t >= :data:`HIGH_NOISE_FROM`), where
   the whole clip's layout, and so the way the shape moves, is decided. In the model shipped before 2026-12-05
   (8x8 tokens a frame), after stage 3 alone the mean prediction at t = 999 put the shape in the same place in
   every frame, and 6 of the 24 held-out prompts moved the asked way; this stage made the direction count;
5. it is tuned as the pictures' DiT was (``train.tune``): half of each batch at high noise, the loss counted
   :data:`~paradiff.builtin.train.KIND_WEIGHT` times more on each frame's kind region (where a circle, a square
   and a triangle would differ), at :data:`KIND_TUNE_LR`, writing the moving average of the weights. After
   stage 3 on an even loss, the asked colour moved the asked way but squares read as circles in half their frames.
   ``--shape-weight W`` also counts the loss W times more on each frame's shape region (as the pictures' option
   does: a colour that bleeds costs an even loss little). ``--tune-from MODEL`` runs this stage alone, again, from
   the video DiT written in ``MODEL/video`` (its tokenizer and text encoder kept), with batches of its own seed
   (:data:`~paradiff.builtin.train.RETUNE_SEED`) and its state in ``video-dit-retune.pt``. ``--kind-draw`` draws the
   clips of the shapes it names more often (e.g. ``square=2,triangle=3``: the kinds the model gets wrong most).

``--vae-tune N --vae-contrast W`` first tunes the VAE N steps from its weights (``train.retune_vae``), its loss
counting W times how far each shape's latents fall short of standing apart from its background's, and encodes the
clips with it: the pictures' VAE puts yellow and orange next to white and purple next to gray, and the video model
draws those shapes worst.

``--motion-only`` trains stage 1's new rows alone and stages 3 to 5's temporal blocks alone
(:func:`train_motion_only`): the picture DiT's weights and its words' encodings stay as the pictures trained them.

The pipeline is written to ``<out>/video`` (weights in float16, the VAE linked from ``../sd/vae``, or with
``--vae-tune``, or from a model that has one, its own VAE).
Bit-identical weights need the same torch version and thread count (``--threads``, default 2).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, LattePipeline, PixArtTransformer2DModel
from transformers import CLIPTextModel

from ..errors import ParadiffError
from . import WEIGHTS
from .clips import CLIP_SIZE, DIRECTION_TOKENS, DIRECTIONS, FRAMES, MOTION_WORDS, Clip, make_clips
from .configs import NOISE_SCHEDULE, build_scheduler, build_tokenizer, build_video_dit
from .scenes import SHAPES, make_scenes
from .train import (
    CAPTION_DROPOUT,
    DATASET_SCENES,
    KIND_WEIGHT,
    RETUNE_SEED,
    THREADS,
    Resumable,
    _save_in_float16,
    link_pictures_vae,
    log,
    optimise,
    parse_loss_weight,
    retune_vae,
    round_to_float16,
    to_pixels,
    token_ids,
    train_text_encoder,
    weighted_mse,
    with_written_weights,
    written_pipeline,
)

#: Clips drawn and encoded at ``--scale 1`` (twice as many are trained on, with their reversals).
DATASET_CLIPS = 500
TEXT_STEPS, VIDEO_STEPS, VIDEO_BATCH, VIDEO_LR = 300, 1400, 4, 5e-4
#: Stage 4: steps, the share of each batch drawn at high noise, and where high noise starts.
HIGH_NOISE_STEPS, HIGH_NOISE_SHARE, HIGH_NOISE_FROM = 1000, 0.5, 700
#: Stage 5's steps, enough that the moving average it writes has left stage 4's weights behind (0.999^600 still
#: kept 55% of them), and its peak learning rate: it goes on from a trained model, as the pictures' ``--tune-from``.
#: Run again from a written model (``--tune-from``), it keeps that peak: unlike the pictures' finished tunings, whose
#: retune runs at a share of theirs, the shipped video model's shape rate was still climbing at its last step.
KIND_TUNE_STEPS, KIND_TUNE_LR = 2700, 0.3 * VIDEO_LR
#: The seed offset of the VAE's tuning (``--vae-tune``), before the clips are encoded.
VAE_TUNE_SEED = 11


def extend_text_encoder(text_encoder: CLIPTextModel, tokenizer) -> CLIPTextModel:
    """``text_encoder`` with an embedding row for each word ``tokenizer`` adds, set to the mean of the others."""
    known = text_encoder.get_input_embeddings().weight.shape[0]
    text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        table = text_encoder.get_input_embeddings().weight
        table[known:] = table[:known].mean(0)
    return text_encoder


def direction_classes(captions: list[str]) -> dict[str, int]:
    """Caption -> 1 + index of its direction of travel in ``DIRECTIONS`` (0: a picture's caption, no motion)."""
    phrases = list(DIRECTIONS)
    return {caption: next((1 + i for i, p in enumerate(phrases) if p in caption), 0) for caption in captions}


@torch.no_grad()
def encode_clips(vae: AutoencoderKL, clips: list[Clip], size: int = CLIP_SIZE) -> torch.Tensor:
    """Scaled latent means of ``clips`` drawn at ``size`` px, ``(N, C, FRAMES, h, w)`` as Latte takes them, encoded
    frame by frame."""
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


def video_batches(
    latents: torch.Tensor,
    clips: list[Clip],
    tokenizer,
    generator: torch.Generator,
    high_noise: bool = False,
    kind_maps: torch.Tensor | None = None,
    kind_draw: dict[str, float] | None = None,
) -> Iterator[tuple]:
    """Endless batches of (noisy latents, v targets, timesteps, token ids, masks, loss weights); an odd index is a
    clip reversed. With ``high_noise``, :data:`HIGH_NOISE_SHARE` of each batch has its timestep drawn from
    ``HIGH_NOISE_FROM`` up. The loss weights are None (an even loss), or with ``kind_maps`` (:func:`kind_maps`) 1
    plus :data:`~paradiff.builtin.train.KIND_WEIGHT` times each drawn clip's map. Clips are drawn evenly, or with
    ``kind_draw`` (kind -> weight, :func:`parse_kind_draw`) each in proportion to its shape's weight.
    Every draw comes from ``generator``, read only as batches are taken, so a resumed stage restores it first."""
    captions = [caption for clip in clips for caption in (clip.caption, clip.reversed().caption)]
    if kind_draw is not None:
        chances = torch.tensor([kind_draw[clip.motion.kind] for clip in clips for _ in range(2)], dtype=torch.float64)
    noise_schedule = DDPMScheduler(**NOISE_SCHEDULE)
    while True:
        if kind_draw is None:
            index = torch.randint(len(captions), (VIDEO_BATCH,), generator=generator)
        else:
            index = torch.multinomial(chances, VIDEO_BATCH, replacement=True, generator=generator)
        drop = torch.rand(VIDEO_BATCH, generator=generator) < CAPTION_DROPOUT
        clean = torch.stack([latents[i // 2].flip(1) if i % 2 else latents[i // 2] for i in index.tolist()])
        maps = None if kind_maps is None else [kind_maps[i // 2].flip(1) if i % 2 else kind_maps[i // 2] for i in index]
        noise = torch.randn(clean.shape, generator=generator)
        levels = NOISE_SCHEDULE["num_train_timesteps"]
        timesteps = torch.randint(levels, (VIDEO_BATCH,), generator=generator)
        if high_noise:
            high = torch.randint(HIGH_NOISE_FROM, levels, (VIDEO_BATCH,), generator=generator)
            timesteps = torch.where(torch.arange(VIDEO_BATCH) < HIGH_NOISE_SHARE * VIDEO_BATCH, high, timesteps)
        noisy = noise_schedule.add_noise(clean, noise, timesteps)
        target = noise_schedule.get_velocity(clean, noise, timesteps)
        kept = zip(index.tolist(), drop.tolist(), strict=True)
        ids, mask = token_ids(tokenizer, ["" if dropped else captions[i] for i, dropped in kept])
        yield noisy, target, timesteps, ids, mask, None if maps is None else 1 + KIND_WEIGHT * torch.stack(maps)


def parse_kind_draw(text: str) -> dict[str, float]:
    """``--kind-draw``'s value, ``"square=2,triangle=3"`` -> each shape's weight in stage 5's draw of clips (a kind
    left out weighs 1)."""
    weights = dict.fromkeys(SHAPES, 1.0)
    for item in text.split(","):
        kind, _, weight = item.partition("=")
        kind = kind.strip()
        if kind not in weights:
            raise argparse.ArgumentTypeError(f"{kind!r} is no shape; use {', '.join(SHAPES)}, e.g. triangle=3")
        try:
            weights[kind] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind}'s weight {weight!r} is no number; e.g. {kind}=2") from None
        if not weights[kind] > 0:
            raise argparse.ArgumentTypeError(f"{kind}'s weight {weight} is not above 0 (1: drawn as often as now)")
    return weights


def train_video_dit(
    dit,
    text_encoder,
    batches,
    steps: int,
    resumable: Resumable | None = None,
    peak_lr: float = VIDEO_LR,
    average: torch.nn.Module | None = None,
) -> None:
    """Latte as its pipeline calls it: the prompt's tokens up to the longest in the batch, no attention mask."""

    def loss_at(step: int) -> torch.Tensor:
        noisy, target, timesteps, ids, mask, weights = next(batches)
        length = int(mask.sum(1).max())
        with torch.no_grad():
            text = text_encoder(ids[:, :length], attention_mask=mask[:, :length])[0]
        prediction = dit(noisy, timestep=timesteps, encoder_hidden_states=text).sample
        return weighted_mse(prediction.chunk(2, dim=1)[0], target, weights)

    optimise(dit.parameters(), steps, peak_lr, loss_at, "video dit", resumable, average)


def video_dit_from(dit: PixArtTransformer2DModel):
    """The Latte DiT holding ``dit``'s weights, its temporal blocks the identity until trained.

    Its output head has twice the channels (``build_video_dit``): both halves start as the DiT's head,
    laid out as Latte un-patchifies (per patch pixel, the channels in order).
    """
    video_dit = build_video_dit(dit, FRAMES)
    weights = dit.state_dict()
    head = {name: weights.pop(f"proj_out.{name}") for name in ("weight", "bias")}
    video_dit.load_state_dict(weights, strict=False)
    patch, channels = dit.config.patch_size, dit.config.out_channels
    with torch.no_grad():
        for name, tensor in head.items():
            per_pixel = tensor.reshape(patch * patch, channels, *tensor.shape[1:])
            getattr(video_dit.proj_out, name).copy_(torch.cat([per_pixel, per_pixel], 1).flatten(0, 1))
        for block in video_dit.temporal_transformer_blocks:
            for layer in (block.attn1.to_out[0], block.ff.net[2]):
                layer.weight.zero_()
                layer.bias.zero_()
    return video_dit


def train_motion_only(video_dit) -> None:
    """Leave only the temporal blocks to train: the spatial blocks, embeddings and head keep the pictures' DiT's
    weights, as AnimateDiff's motion modules train on a frozen image model."""
    video_dit.requires_grad_(False)
    video_dit.temporal_transformer_blocks.requires_grad_(True)


def save_video(out: Path, pictures: Path, tokenizer, text_encoder, vae, dit, own_vae: bool = False) -> None:
    """``video/`` links the pictures' VAE (``../sd/vae`` beside it, else ``pictures``' own) instead of a copy; with
    ``own_vae`` (a VAE tuned for the video model) it holds ``vae`` itself."""
    folder = out / "video"
    if folder.exists():
        shutil.rmtree(folder)
    pipe = LattePipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=dit, scheduler=build_scheduler("pixart")
    )
    _save_in_float16(pipe, folder)
    if not own_vae:
        link_pictures_vae(folder, pictures)


def train(
    out: Path,
    scale: float,
    seed: int,
    pictures: Path,
    resume: Path | None = None,
    size: int = CLIP_SIZE,
    video_steps: int | None = None,
    high_noise_steps: int | None = None,
    checkpoints: Path | None = None,
    kind_tune_steps: int | None = None,
    shape_weight: float = 0.0,
    tune_from: Path | None = None,
    kind_draw: dict[str, float] | None = None,
    vae_tune: int = 0,
    vae_contrast: float = 0.0,
    motion_only: bool = False,
) -> None:
    """All stages, from the picture pipelines in ``pictures`` (a ``paradiff-tiny`` folder), on clips of ``size``
    px; with ``resume`` (a video pipeline folder that stage 3 wrote) stages 4 and 5 alone, on the same clips; with
    ``tune_from`` (a video pipeline folder that stage 5 wrote) stage 5 alone, again (``shape_weight``: its extra
    weight on the shape regions; ``kind_draw``: its weight on each shape's clips, as :func:`video_batches` takes it).

    ``video_steps``, ``high_noise_steps`` and ``kind_tune_steps`` (default: the scaled :data:`VIDEO_STEPS`,
    :data:`HIGH_NOISE_STEPS` and :data:`KIND_TUNE_STEPS`) are stages 3, 4 and 5's steps; with ``checkpoints``
    each saves its state there every :data:`~paradiff.builtin.train.CHECKPOINT_EVERY` steps and a stopped run
    goes on from it (stages 1 and 2 run again: they take minutes and are seeded). The clips are encoded with the
    pictures' VAE, or the written folder's; with ``vae_tune``, that VAE first tuned ``vae_tune`` steps
    (``train.retune_vae``, its contrast term counted ``vae_contrast`` times), and written with the model. With
    ``motion_only`` stage 1 trains only the motion words' embedding rows and stages 3 to 5 only the temporal blocks
    (:func:`train_motion_only`)."""

    def scaled(steps: int) -> int:
        return max(2, round(steps * scale))

    def resumable(name: str, modules: dict, generator: torch.Generator) -> Resumable | None:
        return Resumable(checkpoints / f"{name}.pt", modules, generator) if checkpoints else None

    written = resume or tune_from  # a video folder to go on from: its VAE is the one its DiT learned on
    vae = AutoencoderKL.from_pretrained((written or pictures / "sd") / "vae")
    if vae_tune:
        retune_vae(vae, vae_tune, seed + VAE_TUNE_SEED, vae_contrast, scale_seed=seed + 2)
    vae.requires_grad_(False).eval()
    clips = make_clips(max(4, round(DATASET_CLIPS * scale)), seed)
    if written is None:
        tokenizer, text_encoder, dit = _stages_1_and_2(clips, scale, seed, pictures, motion_only)
        latents = encode_clips(vae, clips, size)
        torch.manual_seed(seed + 2)
        video_dit = video_dit_from(dit)
        if motion_only:
            train_motion_only(video_dit)
        generator = torch.Generator().manual_seed(seed + 3)
        batches = video_batches(latents, clips, tokenizer, generator)
        steps = scaled(VIDEO_STEPS) if video_steps is None else video_steps
        stage_3 = resumable("video-dit", {"video_dit": video_dit}, generator)
        train_video_dit(video_dit, text_encoder, batches, steps, stage_3)
        round_to_float16(video_dit)  # as stage 3's weights ship: a resumed stage 4 starts from the same ones
    else:
        text_encoder = CLIPTextModel.from_pretrained(written / "text_encoder").requires_grad_(False).eval()
        tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)  # as stage 1's: a loaded one saves more
        dit = PixArtTransformer2DModel.from_pretrained(pictures / "pixart" / "transformer")
        hint = f"give the --pictures folder {written} was trained from"
        video_dit = with_written_weights(build_video_dit(dit, FRAMES), written / "transformer", hint)
        if motion_only:
            train_motion_only(video_dit)
        latents = encode_clips(vae, clips, size)
    if tune_from is None:
        torch.manual_seed(seed + 4)
        generator = torch.Generator().manual_seed(seed + 5)
        batches = video_batches(latents, clips, tokenizer, generator, high_noise=True)
        steps = scaled(HIGH_NOISE_STEPS) if high_noise_steps is None else high_noise_steps
        high_noise = resumable("video-dit-high-noise", {"video_dit": video_dit}, generator)
        train_video_dit(video_dit.train(), text_encoder, batches, steps, high_noise)
    kind_tune_steps = scaled(KIND_TUNE_STEPS) if kind_tune_steps is None else kind_tune_steps
    if kind_tune_steps:
        offset = 6 if tune_from is None else RETUNE_SEED
        torch.manual_seed(seed + offset)
        generator = torch.Generator().manual_seed(seed + offset + 1)
        maps = kind_maps(clips, size, latents.shape[-1], shape_weight / KIND_WEIGHT)
        batches = video_batches(latents, clips, tokenizer, generator, True, maps, kind_draw)
        average = copy.deepcopy(video_dit).requires_grad_(False)
        name = "video-dit-kind-tune" if tune_from is None else "video-dit-retune"
        tuning = resumable(name, {"video_dit": video_dit, "average": average}, generator)
        train_video_dit(video_dit.train(), text_encoder, batches, kind_tune_steps, tuning, KIND_TUNE_LR, average)
        video_dit = average
    own_vae = vae_tune > 0 or (written is not None and not (written / "vae").is_symlink())
    save_video(out, pictures, tokenizer, text_encoder, vae, video_dit.eval(), own_vae)


def _stages_1_and_2(clips: list[Clip], scale: float, seed: int, pictures: Path, motion_only: bool = False) -> tuple:
    """The tokenizer, the trained and frozen text encoder (stage 1; with ``motion_only`` only its new words' rows),
    and the pictures' DiT (stage 3 starts from it)."""
    dit = PixArtTransformer2DModel.from_pretrained(pictures / "pixart" / "transformer")
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    text_encoder = CLIPTextModel.from_pretrained(pictures / "sd" / "text_encoder")
    known = text_encoder.get_input_embeddings().weight.shape[0]
    text_encoder = extend_text_encoder(text_encoder, tokenizer)
    clip_captions = [caption for clip in clips for caption in (clip.caption, clip.reversed().caption)]
    scenes = make_scenes(max(32, round(DATASET_SCENES * scale)), seed + 2)
    captions = clip_captions + [scene.caption for scene in scenes]
    torch.manual_seed(seed + 1)
    steps = max(2, round(TEXT_STEPS * scale))
    classes = direction_classes(captions)
    train_text_encoder(text_encoder, tokenizer, captions, steps, seed + 1, classes, known if motion_only else None)
    round_to_float16(text_encoder)
    return tokenizer, text_encoder.eval(), dit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where video/ is written")
    parser.add_argument("--pictures", type=Path, default=WEIGHTS, help="the paradiff-tiny folder to start from")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps and data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--resume", type=Path, help="a video folder written after stage 3: run stages 4 and 5")
    parser.add_argument("--size", type=int, default=CLIP_SIZE, help="the clips' side in pixels")
    parser.add_argument("--video-steps", type=int, help=f"stage 3's steps (default: the scaled {VIDEO_STEPS})")
    parser.add_argument("--high-noise-steps", type=int, help=f"stage 4's (default: the scaled {HIGH_NOISE_STEPS})")
    parser.add_argument("--kind-tune", type=int, help=f"stage 5's (default: the scaled {KIND_TUNE_STEPS}; 0: none)")
    parser.add_argument(
        "--shape-weight", type=parse_loss_weight, default=0.0, help="stage 5's extra loss weight on the shapes"
    )
    parser.add_argument(
        "--kind-draw", type=parse_kind_draw, help="stage 5 draws each shape's clips this much more, e.g. triangle=3"
    )
    parser.add_argument("--tune-from", type=Path, help="a paradiff-tiny folder with video/: run stage 5 alone, again")
    parser.add_argument("--checkpoints", type=Path, help="save stages 3-5's states here and go on from them")
    parser.add_argument("--vae-tune", type=int, default=0, help="first tune the VAE N steps; the model ships it")
    parser.add_argument(
        "--vae-contrast", type=parse_loss_weight, default=0.0, help="--vae-tune's weight on the shapes' contrast"
    )
    parser.add_argument(
        "--motion-only", action="store_true", help="train only the motion words and temporal blocks; keep the DiT's"
    )
    args = parser.parse_args(argv)
    if args.size % 16:
        parser.error(f"--size {args.size} is not a multiple of 16 (the VAE's 8 x the DiT's 2x2 patches); use 256")
    if args.tune_from:
        for flag, value in (
            ("--resume", args.resume),
            ("--video-steps", args.video_steps),
            ("--high-noise-steps", args.high_noise_steps),
        ):
            if value is not None:
                parser.error(f"--tune-from runs stage 5 alone, so {flag} has nothing to do; leave it out")
        if args.kind_tune == 0:
            parser.error("--tune-from runs stage 5 alone; give it --kind-tune N steps (N > 0)")
        if written_pipeline(args.tune_from / "video") != "LattePipeline":
            parser.error(f"--tune-from {args.tune_from} holds no video/ LattePipeline; give a folder this script wrote")
    if args.vae_contrast and not args.vae_tune:
        parser.error("--vae-contrast weighs --vae-tune's loss; give --vae-tune N steps (e.g. 300) with it")
    if args.vae_tune < 0:
        parser.error(f"--vae-tune {args.vae_tune} is below 0; give a number of steps, e.g. 300 (0: the VAE as it is)")
    if args.kind_draw and args.kind_tune == 0:
        parser.error("--kind-draw weighs stage 5's draw, which --kind-tune 0 leaves out; leave one of them out")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    steps = {"video_steps": args.video_steps, "high_noise_steps": args.high_noise_steps}
    steps |= {"kind_tune_steps": args.kind_tune, "shape_weight": args.shape_weight}
    tune_from = args.tune_from / "video" if args.tune_from else None
    try:
        train(
            args.out,
            args.scale,
            args.seed,
            args.pictures,
            args.resume,
            args.size,
            **steps,
            checkpoints=args.checkpoints,
            tune_from=tune_from,
            kind_draw=args.kind_draw,
            vae_tune=args.vae_tune,
            vae_contrast=args.vae_contrast,
            motion_only=args.motion_only,
        )
    except ParadiffError as error:
        parser.error(str(error))
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
