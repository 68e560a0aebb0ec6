"""How often the built-in models draw what a held-out prompt asks: shape, colour, place (or direction), background.

    python benchmarks/follow_bench.py                        # both picture models, 24 held-out prompts x 2 seeds
    python benchmarks/follow_bench.py --models paradiff-tiny-video   # its 24 held-out clips x 2 seeds (~4 min)
    python benchmarks/follow_bench.py --models paradiff-tiny-dit --weights /tmp/tiny/pixart   # other DiT weights
    python benchmarks/follow_bench.py --models paradiff-tiny --guidance 4    # another guidance (or --size)
    python benchmarks/follow_bench.py --seen --guidance 1.5  # the seen prompts, where settings are picked
    python benchmarks/follow_bench.py --quick                # a smoke run: 4 prompts, 1 seed, 4 steps
    python benchmarks/follow_bench.py --models paradiff-tiny-dit --from-step 4 --steps 8   # from the asked picture

Each model draws every prompt of ``paradiff.builtin.scenes.HELD_OUT_PROMPTS`` (one shape each, whose kind, colour
and place together a model trained with ``--hold-out`` never saw) with each seed, on one device, at its default
size, 20 steps, prompted as ``paradiff generate`` prompts it (``--size`` and ``--guidance`` change those two);
``--seen`` draws ``paradiff.builtin.scenes.SEEN_PROMPTS`` instead, whose shapes the model did see, so that a drawing
setting such as the guidance is picked without reading the held-out prompts. Each
picture is read by ``paradiff.builtin.follow`` (from its pixels alone); the table gives, per model, the share of
pictures that get the shape, the colour (at least 85% of the shape's pixels), the place and the background right,
and all four at once; a line under it, the shape's rate for each asked kind. The video model draws each of
``paradiff.builtin.clips.TEST_PROMPTS`` (held out of its training) as one 16-frame clip, read frame by frame
(``judge_clip``: shape and colour in 80% of the frames, the asked direction). With ``--grid PATH`` it also writes
the pictures as one PNG, four prompts a row. Prints the table and writes JSON.

``--from-step K`` locates where in the schedule a model loses a shape: each drawing starts from what its prompt asks
for, drawn by the training data's renderer, noised to the K-th of the steps' timesteps (its seed's noise), and takes
the remaining steps. The U-Nets' DDIM sampler takes no list of timesteps, so the U-Net models (the picture U-Net and
the video model on it) are refused. For the video model a line also gives the share of frames read as the asked
kind, per kind: a clip's shape is right only when 80% of them are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from paradiff.builtin import DEFAULT_SIZE, GUIDANCE_SCALE, call_kwargs
from paradiff.builtin.clips import TEST_PROMPTS
from paradiff.builtin.follow import CHECKS, CLIP_CHECKS, judge, judge_clip, rates, read
from paradiff.builtin.scenes import HELD_OUT_PROMPTS, SEEN_PROMPTS, SHAPES, asked_scene
from paradiff.builtin.train import to_pixels
from paradiff.loading import TRAINED_MODELS, load_pipeline

PICTURE_MODELS = [model for model, kind in TRAINED_MODELS.items() if kind != "video"]
#: The per-kind lines printed under a model's row: result key -> label.
BY_KIND_LINES = {"shape_by_kind": "shape right by asked kind", "frames_by_kind": "frames read as the asked kind"}


def draw_all(
    pipe, kind: str, calls: list[tuple[str, int]], steps: int, size: int, guidance: float, from_step: int | None = None
) -> list[np.ndarray]:
    """The picture (or clip) of every (prompt, seed), 12 pictures or 4 clips a call; with ``from_step``, each started
    from its prompt's asked drawing (:func:`started_from_asked`)."""
    shared = {name: value for name, value in call_kwargs(kind, calls[0][0], warn=False).items() if name != "prompt"}
    shared["guidance_scale"] = guidance
    batch = 4 if kind == "video" else 12
    outputs = []
    for start in range(0, len(calls), batch):
        chunk = calls[start : start + batch]
        started = {} if from_step is None else started_from_asked(pipe, chunk, steps, size, from_step)
        output = pipe(
            **shared,
            **started,
            prompt=[prompt for prompt, _ in chunk],
            generator=[torch.Generator().manual_seed(seed) for _, seed in chunk],
            height=size,
            width=size,
            num_inference_steps=steps,
            output_type="np",
        )
        outputs += list(output.frames if kind == "video" else output.images)
    return [np.asarray(picture) for picture in outputs]


@torch.no_grad()
def started_from_asked(pipe, chunk: list[tuple[str, int]], steps: int, size: int, from_step: int) -> dict:
    """The ``timesteps`` (from the ``from_step``-th of ``steps``) and ``latents`` that start each (prompt, seed) of
    ``chunk`` from the picture its prompt asks for, noised to that timestep by the seed's noise."""
    pipe.scheduler.set_timesteps(steps)
    timesteps = pipe.scheduler.timesteps.tolist()
    started = []
    for prompt, seed in chunk:
        asked = np.stack([asked_scene(prompt).draw(size)])
        clean = pipe.vae.encode(to_pixels(asked)).latent_dist.mean * pipe.vae.config.scaling_factor
        noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
        started.append(pipe.scheduler.add_noise(clean, noise, torch.tensor([timesteps[from_step]])))
    return {"timesteps": timesteps[from_step:], "latents": torch.cat(started)}


def asked_kind_shares(clips: list[np.ndarray], calls: list[tuple[str, int]]) -> dict[str, float]:
    """Per asked kind, the share of all its clips' frames whose shape reads as that kind."""
    shares: dict[str, list[bool]] = {}
    for clip, (prompt, _) in zip(clips, calls, strict=True):
        kind = next(word for word in prompt.split() if word in SHAPES)
        shares.setdefault(kind, []).extend(read(frame).kind == kind for frame in clip)
    return {kind: float(np.mean(read_as)) for kind, read_as in shares.items()}


def write_grid(images: list[np.ndarray], columns: int, path: Path) -> None:
    from PIL import Image

    rows = [np.concatenate(images[start : start + columns], 1) for start in range(0, len(images), columns)]
    Image.fromarray((np.concatenate(rows, 0) * 255).round().astype(np.uint8)).save(path)


def with_weights(pipe, folder: Path) -> None:
    """``pipe``'s denoiser, and its VAE and text encoders where ``folder`` holds them, from ``folder`` (a training
    run's pipeline): a denoiser's latents decoded by a VAE other than the one it learned on come out in that VAE's
    scale and colours, and a video model reads its own motion words' embeddings."""
    denoiser = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    for part in (denoiser, "vae", "text_encoder", "text_encoder_2"):
        if part == denoiser or ((folder / part).is_dir() and getattr(pipe, part, None) is not None):
            setattr(pipe, part, type(getattr(pipe, part)).from_pretrained(folder / part))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PICTURE_MODELS), help="comma-separated built-in models")
    parser.add_argument("--weights", type=Path, help="with one model: its denoiser and VAE from this pipeline folder")
    parser.add_argument("--prompts", type=int, default=len(HELD_OUT_PROMPTS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, help="picture side in pixels (default: each model's default size)")
    parser.add_argument("--guidance", type=float, help="guidance scale (default: each model's built-in guidance)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seen", action="store_true", help="the seen prompts instead of the held-out ones")
    parser.add_argument("--quick", action="store_true", help="4 prompts, 1 seed, 4 steps")
    parser.add_argument("--grid", type=Path, help="also write each picture model's pictures to PATH (name appended)")
    parser.add_argument("--from-step", type=int, help="start from each prompt's asked drawing, noised to this step")
    parser.add_argument("--out", type=Path, default=Path("follow.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.seeds, args.steps = 4, 1, 4
    models = args.models.split(",")
    if args.weights and len(models) != 1:
        parser.error("--weights takes one model")
    if args.seen and any(TRAINED_MODELS[model] == "video" for model in models):
        parser.error("--seen reads the picture models; the video model's prompts are all held out")
    if args.from_step is not None:
        if not 1 <= args.from_step < args.steps:
            last = args.steps - 1
            parser.error(f"--from-step {args.from_step} is not a step after the first of {args.steps}; use 1 to {last}")
        ddim = [model for model in models if TRAINED_MODELS[model] in ("sd", "video")]
        if ddim:
            parser.error(f"--from-step needs a sampler that takes a list of timesteps; {ddim[0]}'s DDIM does not")
    torch.set_num_threads(args.threads)
    seeds = list(range(args.seeds))
    results = []
    for model in models:
        kind = TRAINED_MODELS[model]
        video = kind == "video"
        prompts = list((TEST_PROMPTS if video else SEEN_PROMPTS if args.seen else HELD_OUT_PROMPTS)[: args.prompts])
        pipe = load_pipeline(model)
        if args.weights:
            with_weights(pipe, args.weights)
        pipe.set_progress_bar_config(disable=True)
        calls = [(prompt, seed) for prompt in prompts for seed in seeds]
        size = DEFAULT_SIZE[kind] if args.size is None else args.size
        guidance = GUIDANCE_SCALE[kind] if args.guidance is None else args.guidance
        images = draw_all(pipe, kind, calls, args.steps, size, guidance, args.from_step)
        judged = [
            (judge_clip if video else judge)(image, prompt) for image, (prompt, _) in zip(images, calls, strict=True)
        ]
        misses = {
            f"{prompt} (seed {seed})": [check for check, right in j.items() if not right]
            for (prompt, seed), j in zip(calls, judged, strict=True)
            if not all(j.values())
        }
        checks = CLIP_CHECKS if video else CHECKS
        asked_kinds = [next(word for word in prompt.split() if word in SHAPES) for prompt, _ in calls]
        by_kind = {
            kind: rates([j for j, asked in zip(judged, asked_kinds, strict=True) if asked == kind])["shape"]
            for kind in SHAPES
            if kind in asked_kinds
        }
        results.append({"model": model, "size": size, "guidance": guidance, "checks": checks, "drawn": len(images)})
        results[-1] |= {"prompts": prompts, "rates": rates(judged), "shape_by_kind": by_kind, "misses": misses}
        if video:
            results[-1]["frames_by_kind"] = asked_kind_shares(images, calls)
        if args.grid and not video:
            write_grid(images, 4 * len(seeds), args.grid.with_name(f"{args.grid.stem}-{model}{args.grid.suffix}"))
    for r in results:
        print(f"| model | size | guidance | drawn | {' | '.join(r['checks'])} | all |")
        print("|---|---|---|---|" + "---|" * (len(r["checks"]) + 1))
        shares = " | ".join(f"{100 * r['rates'][check]:.0f}%" for check in (*r["checks"], "all"))
        print(f"| {r['model']} | {r['size']} px | {r['guidance']:g} | {r['drawn']} | {shares} |")
        for key, label in BY_KIND_LINES.items():
            if key in r:
                print(f"{label}: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r[key].items()))
    run = {"seeds": seeds, "steps": args.steps, "from_step": args.from_step}
    args.out.write_text(json.dumps(run | {"results": results}, indent=1))


if __name__ == "__main__":
    main()
