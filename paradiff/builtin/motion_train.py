"""Train a video model on the picture U-Net with diffusers' AnimateDiff motion modules, on the CPU.

    python -m paradiff.builtin.motion_train --out DIR --checkpoints STATE   # writes DIR/video; resumable
    python -m paradiff.builtin.motion_train --scale 0.01 --out /tmp/motion  # a quick smoke run
    python -m paradiff.builtin.motion_train --out DIR --tune-from DIR --clip-tune 2000  # the last stage again

The picture U-Net follows prompts best of the built-in models because it reads the caption outside
cross-attention too: its pooled embedding steers every ResNet. diffusers' video U-Net (``UNetMotionModel``) builds
only SDXL's kind of added embedding (``addition_embed_type="text_time"``: the pooled output of a
``CLIPTextModelWithProjection`` and the size conditions) and ResNets with an additive time embedding, so the video
model is an ``AnimateDiffSDXLPipeline`` and is made in stages, each seeded:

1. **A picture U-Net of SDXL's kind** from the shipped one's weights (the added embedding and each ResNet's time
   projection are new), and a second text encoder: the shipped one with a third layer that starts as the identity.
   The SDXL pipelines read the second-to-last layer for cross-attention, the shipped encoder's last, and the pooled
   output of the third, which trains with the U-Net. transformers' CLIP pools at the highest token id when the end
   token's id is 2, as the built-in tokenizer's is (a rule kept for old checkpoints); in these captions that is a
   word in the middle, which under the causal mask has not seen the rest, so this tokenizer ends each caption with an
   end word of the highest id, embedded as the end token was (:func:`pooled_tokenizer`). Trained on the pictures
   (held-out shapes left out), then tuned as the U-Net was (``train.tune``: high noise, the kind region weighted);
2. **motion modules** (a ``MotionAdapter`` at each level and the middle) whose output projections start at zero, so
   that the model starts as the picture U-Net on every frame;
3. **the clips** at :data:`SIZE` px, every weight but the text encoder's first two layers (its motion words' rows
   start at the mean of the others), each clip also played backwards (:mod:`~paradiff.builtin.clip_batches`): plain,
   then half of each batch at high noise, then tuned on the kind and shape regions writing the moving average.
   ``--tune-from MODEL`` runs that tuning alone, again, from the video model in ``MODEL/video`` (its tokenizer,
   text encoder and VAE kept), with batches of its own seed (:data:`~paradiff.builtin.train.RETUNE_SEED`) and its
   state in ``clips-retune.pt``: the held-out rates were still rising at the first run's last step.
   ``--colour-weight W --small-draw S`` (:class:`Tuning`) make the tuning hold colour: W times
   :func:`colour_error` in its loss, small shapes' clips drawn S times as often; ``--focus WORDS --focus-draw D``
   draws the clips of a pairing D times as often, and ``--tune-noise low`` puts half of each batch at low noise
   instead of high. A retune with any of these is a stage of its own (:data:`COLOUR_RETUNE_SEED`, state
   ``clips-colour-retune.pt``).

The pipeline is written to ``<out>/video`` (weights in float16, the VAE linked from ``../sd/vae`` beside it, as
the shipped ``paradiff-tiny`` folder holds it).
Bit-identical weights need the same torch version and thread count (``--threads``, default 2).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AnimateDiffSDXLPipeline,
    AutoencoderKL,
    DDPMScheduler,
    MotionAdapter,
    UNet2DConditionModel,
    UNetMotionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from . import WEIGHTS
from .clip_batches import (
    DATASET_CLIPS,
    KIND_TUNE_LR,
    NOISE_BANDS,
    VIDEO_LR,
    encode_clips,
    kind_maps,
    shape_maps,
    video_batches,
)
from .clips import DIRECTION_TOKENS, FRAMES, MOTION_WORDS, Motion, make_clips
from .configs import NOISE_SCHEDULE, UNET_IMAGE_SIZE, build_scheduler, build_tokenizer
from .scenes import BACKGROUNDS, COLOURS, SHAPES, SIZES
from .train import (
    DATASET_SCENES,
    KIND_WEIGHT,
    RETUNE_SEED,
    THREADS,
    TUNE_LR,
    Resumable,
    _save_in_float16,
    denoiser_batches,
    encode_dataset,
    link_pictures_vae,
    log,
    optimise,
    round_to_float16,
    tune,
    weighted_mse,
    with_written_weights,
    written_pipeline,
)

#: The clips' and pictures' side: the U-Net's training size (16x16 latents).
SIZE = UNET_IMAGE_SIZE
#: The word that ends every caption, of the highest token id (:func:`pooled_tokenizer`).
END_WORD = "endofcaption"
#: Each size condition's embedding width; with the 6 conditions and the 64-wide pooled caption, the added
#: embedding reads 112 numbers.
TIME_ID_WIDTH = 8
#: Stage 1's steps (plain, then tuning) and stage 3's (plain, high noise, tuning) at ``--scale 1``.
PICTURE_STEPS, PICTURE_TUNE_STEPS = 1000, 2000
CLIP_STEPS, CLIP_HIGH_NOISE_STEPS, CLIP_TUNE_STEPS = 1000, 1000, 3000
#: The tuning stages' extra loss weight on the shape region, as the shipped U-Net's.
SHAPE_WEIGHT = 5.0
#: The seed offset (past ``RETUNE_SEED``) of a retune that holds colour (or draws otherwise than the first tuning):
#: its batches are not the plain retune's.
COLOUR_RETUNE_SEED = 3
#: The words ``--focus`` takes: what a clip's motion shows but its direction.
FOCUS_WORDS = frozenset([*SHAPES, *SIZES, *COLOURS, *BACKGROUNDS])
#: The training noise schedule's alpha_bar per timestep (:func:`colour_error` reads the clean latents' error).
ALPHAS_CUMPROD = DDPMScheduler(**NOISE_SCHEDULE).alphas_cumprod


def scaled_steps(steps: int, scale: float) -> int:
    """A stage's steps at ``--scale``: at least 2, so that a smoke run still takes a step after the warm-up's first."""
    return max(2, round(steps * scale))


def pooled_tokenizer():
    """The video model's tokenizer (the pictures' words, then the motion words) ending each caption with
    :data:`END_WORD`, of the highest id, instead of the end token."""
    return build_tokenizer((*MOTION_WORDS, END_WORD), DIRECTION_TOKENS, end_word=END_WORD)


def pooled_text_encoder(shipped: CLIPTextModel, tokenizer) -> CLIPTextModelWithProjection:
    """``shipped`` with a third layer that starts as the identity, an embedding row for each word ``tokenizer`` adds
    (the motion words at the mean of the others, :data:`END_WORD` as the end token) and a projection: the SDXL
    pipelines' second text encoder. Only the third layer, the final norm and the projection train (and, on clips,
    the embedding table)."""
    config = copy.deepcopy(shipped.config)
    end = tokenizer.convert_tokens_to_ids(END_WORD)
    config.num_hidden_layers, config.vocab_size, config.eos_token_id = 3, len(tokenizer), end
    encoder = CLIPTextModelWithProjection(config)
    model, known = encoder.text_model, shipped.embeddings.token_embedding.weight.shape[0]
    with torch.no_grad():
        table = model.embeddings.token_embedding.weight
        table[:known] = shipped.embeddings.token_embedding.weight
        table[known:] = table[:known].mean(0)
        table[end] = shipped.embeddings.token_embedding.weight[shipped.config.eos_token_id]
        model.embeddings.position_embedding.load_state_dict(shipped.embeddings.position_embedding.state_dict())
        for layer, kept in zip(model.encoder.layers, shipped.encoder.layers, strict=False):
            layer.load_state_dict(kept.state_dict())
        model.final_layer_norm.load_state_dict(shipped.final_layer_norm.state_dict())
        last = model.encoder.layers[-1]
        for linear in (last.self_attn.out_proj, last.mlp.fc2):
            linear.weight.zero_()
            linear.bias.zero_()
    encoder.requires_grad_(False)
    for part in (model.encoder.layers[-1], model.final_layer_norm, encoder.text_projection):
        part.requires_grad_(True)
    return encoder


def sdxl_unet_from(shipped: UNet2DConditionModel, pooled_width: int) -> UNet2DConditionModel:
    """A U-Net of SDXL's kind holding ``shipped``'s weights where the shapes agree (all but the added embedding and
    the ResNets' time projections, which a scale-and-shift embedding makes twice as wide)."""
    config = dict(shipped.config)
    config |= {
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": TIME_ID_WIDTH,
        "projection_class_embeddings_input_dim": pooled_width + 6 * TIME_ID_WIDTH,
        "resnet_time_scale_shift": "default",
    }
    unet = UNet2DConditionModel.from_config(config)
    fresh = unet.state_dict()
    kept = {name: w for name, w in shipped.state_dict().items() if name in fresh and fresh[name].shape == w.shape}
    unet.load_state_dict(kept, strict=False)
    return unet


class Drawer(torch.nn.Module):
    """The U-Net and the text encoder it reads, as the SDXL pipelines call them, in one module: trained, averaged
    and saved together. Latents of five dimensions are clips (batch, channels, frames, height, width)."""

    def __init__(self, unet, text_encoder: CLIPTextModelWithProjection, size: int = SIZE):
        super().__init__()
        self.unet, self.text_encoder = unet, text_encoder
        self.register_buffer("time_ids", torch.tensor([size, size, 0, 0, size, size], dtype=torch.float32), False)

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        encoded = self.text_encoder(ids, output_hidden_states=True)
        states = encoded.hidden_states[-2]
        if noisy.ndim == 5:
            states = states.repeat_interleave(noisy.shape[2], dim=0)
        conditions = {"text_embeds": encoded.text_embeds, "time_ids": self.time_ids.expand(len(ids), -1)}
        return self.unet(noisy, timesteps, encoder_hidden_states=states, added_cond_kwargs=conditions).sample


def train_drawer(
    drawer: Drawer,
    _text_encoder,
    batches,
    steps: int,
    resumable: Resumable | None = None,
    peak_lr: float = TUNE_LR,
    average: torch.nn.Module | None = None,
    name: str = "drawer",
    colour_weight: float = 0.0,
) -> None:
    """``drawer`` on ``batches`` (``train.denoiser_batches`` or ``clip_batches.video_batches``); the signature is
    ``train.tune``'s trainer's (the text encoder is the drawer's own). With ``colour_weight`` the loss adds that
    many times :func:`colour_error` (the batches carry shape maps)."""

    def loss_at(step: int) -> torch.Tensor:
        noisy, target, timesteps, ids, _, weights, *shapes = next(batches)
        prediction = drawer(noisy, timesteps, ids)
        loss = weighted_mse(prediction, target, weights)
        if colour_weight:
            loss = loss + colour_weight * colour_error(prediction, target, timesteps, shapes[0])
        return loss

    optimise(drawer.parameters(), steps, peak_lr, loss_at, name, resumable, average)


def colour_error(prediction: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor, shapes: torch.Tensor):
    """How far each frame's predicted clean latents, averaged over its shape region, fall from the clip's: squared,
    over channels and frames, averaged over the clips with a shape map (``shapes``, zero where no colour was asked).

    The flat loss spreads a shape's colour error over its pixels, where the noise's own error drowns it; this term
    reads the region's mean, which is the colour, frame by frame: a shape whose hue flickers between frames pays for
    every frame that misses. For v-prediction the clean latents' error is ``-sqrt(1 - alpha_bar)`` times v's.
    """
    scale = (1 - ALPHAS_CUMPROD[timesteps]).sqrt().view(-1, 1, 1, 1, 1)
    error = (prediction - target) * scale
    region = (error * shapes).sum((-1, -2)) / shapes.sum((-1, -2)).clamp_min(1e-3)
    asked = shapes.flatten(1).sum(1) > 0
    return (region**2).mean((1, 2))[asked].mean() if asked.any() else prediction.new_zeros(())


def motion_adapter_for(config) -> MotionAdapter:
    """Motion modules for a U-Net of ``config`` (its picture form or its ``UNetMotionModel``): its levels, layers and
    norm groups, the heads of its attention at each level, :data:`~paradiff.builtin.clips.FRAMES` positions,
    and a middle block."""
    return MotionAdapter(
        block_out_channels=tuple(config.block_out_channels),
        motion_layers_per_block=config.layers_per_block,
        motion_norm_num_groups=config.norm_num_groups,
        # a motion U-Net names its motion modules' heads; a picture U-Net's heads per level are its attention_head_dim
        motion_num_attention_heads=tuple(config.get("motion_num_attention_heads", config.get("attention_head_dim"))),
        motion_max_seq_length=FRAMES,
        use_motion_mid_block=True,
    )


def with_motion(drawer: Drawer) -> Drawer:
    """``drawer`` with its U-Net turned into a ``UNetMotionModel``: motion modules whose output projections are zero
    (each starts as the identity), and the added embedding, which ``from_unet2d`` leaves out, copied over."""
    adapter = motion_adapter_for(drawer.unet.config)
    with torch.no_grad():
        for name, module in adapter.named_modules():
            if name.endswith("proj_out"):
                module.weight.zero_()
                module.bias.zero_()
    unet = UNetMotionModel.from_unet2d(drawer.unet, adapter)
    unet.add_embedding.load_state_dict(drawer.unet.add_embedding.state_dict())
    drawer.unet = unet
    return drawer


def save_motion(out: Path, pictures: Path, tokenizer, vae, drawer: Drawer) -> None:
    """``<out>/video``: an ``AnimateDiffSDXLPipeline`` with the second text encoder only, which encodes the empty
    prompt for guidance as training dropped captions to it (not SDXL's zeros); its VAE linked to the pictures'."""
    folder = out / "video"
    if folder.exists():
        shutil.rmtree(folder)
    unet = drawer.unet
    adapter = motion_adapter_for(unet.config)
    adapter.load_state_dict({k: v for k, v in unet.state_dict().items() if "motion_modules" in k})
    pipe = AnimateDiffSDXLPipeline(
        vae=vae,
        text_encoder=None,
        text_encoder_2=drawer.text_encoder,
        tokenizer=None,
        tokenizer_2=tokenizer,
        unet=unet,
        motion_adapter=adapter,
        scheduler=build_scheduler("sd"),
        force_zeros_for_empty_prompt=False,
    )
    _save_in_float16(pipe, folder)
    link_pictures_vae(folder, pictures)


@dataclass(frozen=True)
class Tuning:
    """What the tuning stage weighs up. Its hold on colour: ``colour_weight`` times :func:`colour_error` added to its
    loss, and the clips of small shapes drawn ``small_draw`` times as often (their few latents are where the hue
    flickers most). The clips whose motion has every word of ``focus`` (kind, size, colour or background words)
    drawn ``focus_draw`` times as often: a pairing the model misses. ``band``, the noise band (a key of
    :data:`~paradiff.builtin.clip_batches.NOISE_BANDS`) half of each batch is drawn from: high, where the layout is
    decided, or low, where the edges are drawn."""

    colour_weight: float = 0.0
    small_draw: float = 1.0
    focus: tuple[str, ...] = ()
    focus_draw: float = 1.0
    band: str = "high"

    def chance(self, motion: Motion) -> float:
        """How many times as often as the others a clip showing ``motion`` is drawn."""
        chance = self.small_draw if motion.size == "small" else 1.0
        words = {motion.kind, motion.size, motion.colour, motion.background}
        return chance * (self.focus_draw if self.focus and set(self.focus) <= words else 1.0)


def clip_trainable(drawer: Drawer) -> Drawer:
    """On clips every weight trains but the text encoder's first two layers: the shipped encoder's, which the U-Net's
    cross-attention reads."""
    drawer.requires_grad_(True)
    for layer in drawer.text_encoder.text_model.encoder.layers[:-1]:
        layer.requires_grad_(False)
    return drawer


def tune_clips(
    drawer: Drawer,
    clips: list,
    latents: torch.Tensor,
    tokenizer,
    size: int,
    steps: int,
    seed: int,
    checkpoints: Path | None,
    name: str,
    tuning: Tuning = Tuning(),
) -> Drawer:
    """Stage 3's tuning: ``steps`` on ``clips`` (their ``latents``, drawn at ``size`` px, captions read by
    ``tokenizer``) with batches seeded ``seed``, half of each batch in ``tuning``'s noise band and the loss weighed
    up on each frame's kind and shape regions (and as ``tuning`` asks, its colour term, and clips drawn unevenly);
    returns the moving average of the weights. With ``checkpoints`` the state is saved there as ``<name>.pt``."""
    generator = torch.Generator().manual_seed(seed)
    side = latents.shape[-1]
    maps = kind_maps(clips, size, side, SHAPE_WEIGHT / KIND_WEIGHT)
    chances = [tuning.chance(clip.motion) for clip in clips]
    chances = None if set(chances) == {1.0} else chances
    shapes = shape_maps(clips, size, side) if tuning.colour_weight else None
    batches = video_batches(latents, clips, tokenizer, generator, tuning.band, maps, chances, shapes)
    average = copy.deepcopy(drawer).requires_grad_(False)
    modules = {"drawer": drawer, "average": average}
    state = Resumable(checkpoints / f"{name}.pt", modules, generator) if checkpoints else None
    train_drawer(
        drawer, None, batches, steps, state, KIND_TUNE_LR, average, name.replace("-", " "), tuning.colour_weight
    )
    return average.eval()


def train(
    out: Path,
    scale: float,
    seed: int,
    pictures: Path,
    checkpoints: Path | None = None,
    size: int = SIZE,
    clip_tune_steps: int | None = None,
    tuning: Tuning = Tuning(),
) -> None:
    """All stages from the ``paradiff-tiny`` folder ``pictures`` (its U-Net, VAE and text encoder), on pictures and
    clips of ``size`` px; with ``checkpoints`` each stage saves its state there and a stopped run goes on from it.
    ``clip_tune_steps`` (default: the scaled :data:`CLIP_TUNE_STEPS`) are the last stage's steps, ``tuning`` what it
    weighs up."""

    def resumable(name: str, modules: dict, generator: torch.Generator) -> Resumable | None:
        return Resumable(checkpoints / f"{name}.pt", modules, generator) if checkpoints else None

    vae = AutoencoderKL.from_pretrained(pictures / "sd" / "vae").requires_grad_(False).eval()
    tokenizer = pooled_tokenizer()
    shipped = CLIPTextModel.from_pretrained(pictures / "sd" / "text_encoder")
    torch.manual_seed(seed + 1)
    text_encoder = pooled_text_encoder(shipped, tokenizer)
    unet = sdxl_unet_from(UNet2DConditionModel.from_pretrained(pictures / "sd" / "unet"), shipped.config.hidden_size)
    drawer = Drawer(unet, text_encoder, size)

    count = max(8, round(DATASET_SCENES * scale))
    shape_share = SHAPE_WEIGHT / KIND_WEIGHT
    latents, captions, maps = encode_dataset(vae, count, seed + 2, size, True, shape_share)
    latents = latents * vae.config.scaling_factor
    generator = torch.Generator().manual_seed(seed + 3)
    batches = denoiser_batches(latents, captions, tokenizer, generator)
    train_drawer(
        drawer, None, batches, scaled_steps(PICTURE_STEPS, scale), resumable("pictures", {"drawer": drawer}, generator)
    )
    generator = torch.Generator().manual_seed(seed + 4)
    batches = denoiser_batches(latents, captions, tokenizer, generator, True, maps)
    drawer = tune(
        "pictures", drawer, train_drawer, None, batches, generator, scaled_steps(PICTURE_TUNE_STEPS, scale), checkpoints
    )
    round_to_float16(drawer)

    torch.manual_seed(seed + 5)
    drawer = clip_trainable(with_motion(drawer))
    clips = make_clips(max(4, round(DATASET_CLIPS * scale)), seed)
    clip_latents = encode_clips(vae, clips, size)
    for stage, steps, band in (("clips", CLIP_STEPS, None), ("clips-high-noise", CLIP_HIGH_NOISE_STEPS, "high")):
        generator = torch.Generator().manual_seed(seed + (6 if band else 7))
        batches = video_batches(clip_latents, clips, tokenizer, generator, band)
        state = resumable(stage, {"drawer": drawer}, generator)
        train_drawer(drawer, None, batches, scaled_steps(steps, scale), state, VIDEO_LR, name=stage)
    steps = scaled_steps(CLIP_TUNE_STEPS, scale) if clip_tune_steps is None else clip_tune_steps
    stage = (steps, seed + 8, checkpoints, "clips-tune", tuning)
    average = tune_clips(drawer, clips, clip_latents, tokenizer, size, *stage)
    save_motion(out, pictures, tokenizer, vae, average)


def retune(
    out: Path,
    model: Path,
    scale: float,
    seed: int,
    pictures: Path,
    checkpoints: Path | None,
    size: int,
    clip_tune_steps: int | None = None,
    tuning: Tuning = Tuning(),
) -> None:
    """Stage 3's tuning alone, again, ``clip_tune_steps`` (default: the scaled :data:`CLIP_TUNE_STEPS`) from the video
    model in ``model/video`` on the same clips, with batches of seed ``seed + RETUNE_SEED + 1`` (with any other
    ``tuning``, a stage of its own: ``+ COLOUR_RETUNE_SEED``); the model's text encoder, tokenizer and VAE are kept."""
    steps = scaled_steps(CLIP_TUNE_STEPS, scale) if clip_tune_steps is None else clip_tune_steps
    folder, tokenizer = model / "video", pooled_tokenizer()
    vae = AutoencoderKL.from_pretrained(folder / "vae").requires_grad_(False).eval()
    text_encoder = CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder_2")
    # built from its config, the U-Net writes no folder name in it: what a fresh run would write
    unet = with_written_weights(
        UNetMotionModel.from_config(UNetMotionModel.load_config(folder / "unet")), folder / "unet"
    )
    torch.manual_seed(seed + RETUNE_SEED)
    drawer = clip_trainable(Drawer(unet, text_encoder, size))
    clips = make_clips(max(4, round(DATASET_CLIPS * scale)), seed)
    latents = encode_clips(vae, clips, size)
    if tuning == Tuning():
        state, tuning_seed = "clips-retune", seed + RETUNE_SEED + 1
    else:
        state, tuning_seed = "clips-colour-retune", seed + RETUNE_SEED + COLOUR_RETUNE_SEED
    average = tune_clips(drawer, clips, latents, tokenizer, size, steps, tuning_seed, checkpoints, state, tuning)
    save_motion(out, pictures, tokenizer, vae, average)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where video/ is written")
    parser.add_argument("--pictures", type=Path, default=WEIGHTS, help="the paradiff-tiny folder to start from")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps and data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--checkpoints", type=Path, help="save each stage's state here and go on from it")
    parser.add_argument("--size", type=int, default=SIZE, help="the pictures' and clips' side in pixels")
    parser.add_argument("--clip-tune", type=int, help=f"the last stage's steps (default: the scaled {CLIP_TUNE_STEPS})")
    parser.add_argument("--tune-from", type=Path, help="a paradiff-tiny folder with video/: run the last stage again")
    parser.add_argument(
        "--colour-weight",
        type=float,
        default=0.0,
        help="the last stage adds W times each frame's colour error on its shape region to its loss (default 0)",
    )
    parser.add_argument(
        "--small-draw", type=float, default=1.0, help="the last stage draws small shapes' clips S times as often"
    )
    parser.add_argument(
        "--focus",
        default="",
        metavar="WORDS",
        help="comma-separated kind, size, colour or background words, e.g. small,square,gray: the clips showing all "
        "of them are drawn --focus-draw times as often",
    )
    parser.add_argument(
        "--focus-draw", type=float, default=1.0, metavar="D", help="how many times as often --focus is drawn"
    )
    parser.add_argument(
        "--tune-noise",
        choices=sorted(NOISE_BANDS),
        default="high",
        help="the noise band half of each of the last stage's batches is drawn from: high, where the layout is "
        "decided (the default), or low, where the edges are drawn ("
        + ", ".join(f"{name}: timesteps {low}-{high - 1}" for name, (low, high) in NOISE_BANDS.items())
        + ")",
    )
    args = parser.parse_args(argv)
    if args.size % 32:
        parser.error(f"--size {args.size} is not a multiple of 32 (the VAE's 8 x the U-Net's two halvings); use {SIZE}")
    if args.clip_tune is not None and args.clip_tune < 1:
        parser.error(f"--clip-tune {args.clip_tune} is below 1; give a number of steps, e.g. {CLIP_TUNE_STEPS}")
    if args.tune_from is not None and written_pipeline(args.tune_from / "video") != "AnimateDiffSDXLPipeline":
        parser.error(
            f"--tune-from {args.tune_from} holds no video/ AnimateDiffSDXLPipeline; give a folder this script wrote"
        )
    if args.colour_weight < 0:
        parser.error(f"--colour-weight {args.colour_weight:g} is below 0; give 0 (no colour term) or more, e.g. 2")
    if args.small_draw <= 0:
        parser.error(f"--small-draw {args.small_draw:g} is not above 0; give 1 (an even draw) or more, e.g. 2")
    focus = tuple(word for word in args.focus.split(",") if word)
    unknown = [word for word in focus if word not in FOCUS_WORDS]
    if unknown:
        parser.error(f"--focus word {unknown[0]!r} is no kind, size, colour or background; give e.g. small,square,gray")
    if args.focus_draw <= 0:
        parser.error(f"--focus-draw {args.focus_draw:g} is not above 0; give 1 (an even draw) or more, e.g. 4")
    if args.focus_draw != 1 and not focus:
        parser.error(f"--focus-draw {args.focus_draw:g} draws nothing more often without --focus; name the words")
    tuning = Tuning(args.colour_weight, args.small_draw, focus, args.focus_draw, args.tune_noise)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.tune_from is None:
        train(args.out, args.scale, args.seed, args.pictures, args.checkpoints, args.size, args.clip_tune, tuning)
    else:
        where = (args.out, args.tune_from, args.scale, args.seed, args.pictures, args.checkpoints, args.size)
        retune(*where, args.clip_tune, tuning)
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
