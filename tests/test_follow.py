"""The follow measure (``paradiff.builtin.follow``) and the held-out prompts the DiT never trained on."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from paradiff.builtin.clips import make_clips
from paradiff.builtin.follow import CHECKS, Asked, judge, judge_clip, rates, read
from paradiff.builtin.scenes import (
    BACKGROUNDS,
    COLOURS,
    HELD_OUT_PROMPTS,
    PLACES,
    SEEN_PROMPTS,
    SHAPES,
    make_scenes,
    shapes_named,
    shows_held_out,
)
from paradiff.builtin.train import encode_dataset, mirrored


def painted(kind: str, colour, centre: tuple[float, float], diameter: float, size: int, background) -> np.ndarray:
    """A picture drawn here, by masks on a pixel grid (not by the training data's renderer)."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = background
    ys, xs = (np.mgrid[0:size, 0:size] + 0.5) / size
    dx, dy, r = xs - centre[0], ys - centre[1], diameter / 2
    masks = {
        "circle": dx**2 + dy**2 <= r**2,
        "square": (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r),
        "triangle": (dy >= -r) & (dy <= 0.8 * r) & (np.abs(dx) <= (dy + r) / 1.8),
    }
    image[masks[kind]] = colour
    return image


def test_reads_the_training_scenes_right_at_every_size():
    for size in (128, 256, 512):
        for scene in make_scenes(40, seed=11):
            if len(scene.shapes) == 1:
                assert all(judge(scene.draw(size), scene.caption).values()), (size, scene.caption)


def test_reads_shapes_painted_another_way():
    rng = random.Random(5)
    for _ in range(60):
        kind, colour, place = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(PLACES))
        background = rng.choice(list(BACKGROUNDS))
        cx, cy = PLACES[place]
        centre = (cx + rng.uniform(-0.05, 0.05), cy + rng.uniform(-0.05, 0.05))
        size = rng.choice((128, 320, 512))
        image = painted(kind, COLOURS[colour], centre, rng.uniform(0.18, 0.4), size, BACKGROUNDS[background])
        reading = read(image)
        assert (reading.kind, reading.place, reading.background) == (kind, place, background)
        assert reading.colour_share(colour) > 0.99


def test_does_not_count_what_a_person_would_not():
    """Each picture below is wrong in one way the older colour-near-the-place reading let through."""
    prompt = "a large red circle at the top left on a white background"
    white, red, green = BACKGROUNDS["white"], COLOURS["red"], COLOURS["green"]
    circle = painted("circle", red, (0.22, 0.22), 0.36, 256, white)
    assert all(judge(circle, prompt).values())

    half_green = circle.copy()
    half_green[:, 56:][(circle[:, 56:] == red).all(-1)] = green
    assert judge(half_green, prompt) == {"shape": True, "colour": False, "place": True, "background": True}

    patchy = circle.copy()
    patchy[(np.add.outer(np.arange(256) // 12, np.arange(256) // 12) % 2 == 0) & (circle == red).all(-1)] = white
    assert not judge(patchy, prompt)["shape"]

    as_square = painted("square", red, (0.22, 0.22), 0.36, 256, white)
    assert judge(as_square, prompt)["shape"] is False and read(as_square).kind == "square"

    elsewhere = painted("circle", red, (0.5, 0.5), 0.36, 256, white)
    assert judge(elsewhere, prompt)["place"] is False

    assert judge(np.full((256, 256, 3), white, dtype=np.uint8), prompt)["shape"] is False


def test_rates_count_each_check_and_all_at_once():
    right = {check: True for check in CHECKS}
    judged = [right, right | {"colour": False}, right | {"place": False, "colour": False}, right]
    assert rates(judged) == {"shape": 1.0, "colour": 0.5, "place": 0.75, "background": 1.0, "all": 0.5}
    with pytest.raises(ValueError, match="no pictures"):
        rates([])


def test_asked_reads_one_shape_prompts_and_refuses_two():
    assert Asked.of("a small blue square in the center") == Asked("square", "blue", "in the center", None)
    with pytest.raises(ValueError, match="one-shape"):
        Asked.of("a small red circle at the top and a small blue square at the bottom")


def test_held_out_prompts_are_each_a_different_colour_and_place():
    named = [shapes_named(prompt)[0] for prompt in HELD_OUT_PROMPTS]
    assert len(HELD_OUT_PROMPTS) == 24 and len({(colour, place) for _, colour, place in named}) == 24
    assert all(shows_held_out(prompt) for prompt in HELD_OUT_PROMPTS)


def test_seen_prompts_show_no_held_out_shape_and_each_a_different_colour_and_place():
    """Settings picked on the seen prompts read nothing of the held-out ones, and still span the kinds."""
    named = [shapes_named(prompt)[0] for prompt in SEEN_PROMPTS]
    assert len(SEEN_PROMPTS) == 24 and len({(colour, place) for _, colour, place in named}) == 24
    assert not any(shows_held_out(prompt) for prompt in SEEN_PROMPTS)
    assert {kind for kind, _, _ in named} == set(SHAPES)


def test_training_data_leaves_the_held_out_shapes_out():
    """With ``--hold-out`` the data drops each scene, and each mirror image, that shows a held-out prompt's shape;
    without it, none."""
    vae = types.SimpleNamespace(
        encode=lambda pixels: types.SimpleNamespace(latent_dist=types.SimpleNamespace(mean=pixels[:, :4, ::8, ::8]))
    )
    scenes = make_scenes(400, seed=2)
    latents, captions, kind_maps = encode_dataset(vae, 400, seed=2, size=64, hold_out=True)
    every = [caption for scene in scenes for caption in (scene.caption, mirrored(scene))]
    assert not any(shows_held_out(caption) for caption in captions)
    assert len(captions) == len(latents) == len(kind_maps) == sum(not shows_held_out(c) for c in every) < len(every)
    mirrored_out = [s for s in scenes if shows_held_out(mirrored(s)) and not shows_held_out(s.caption)]
    assert mirrored_out and all(s.caption in captions and mirrored(s) not in captions for s in mirrored_out)
    assert sorted(encode_dataset(vae, 400, seed=2, size=64)[1]) == sorted(every)


def test_each_latent_comes_with_its_own_scenes_kind_map():
    """The maps follow the latents' order (scenes, then their mirror images) and size: each is the share of its
    latent's pixels in the scene's kind region, flipped with the mirror image; with a shape share, plus that share
    of its pixels in the shape region."""
    vae = types.SimpleNamespace(
        encode=lambda pixels: types.SimpleNamespace(latent_dist=types.SimpleNamespace(mean=pixels[:, :4, ::8, ::8]))
    )
    latents, _, kind_maps = encode_dataset(vae, 32, seed=2, size=64)
    assert kind_maps.shape == (64, 1, 8, 8) == (len(latents), 1, *latents.shape[-2:])
    for index, scene in enumerate(make_scenes(32, seed=2)):
        shares = torch.from_numpy(scene.kind_region(64).reshape(8, 8, 8, 8).mean((1, 3)))
        assert torch.allclose(kind_maps[index, 0], shares.float())
        assert torch.allclose(kind_maps[32 + index, 0], shares.float().flip(-1))
        assert shares.max() > 0
    with_shapes = encode_dataset(vae, 32, seed=2, size=64, shape_share=0.5)[2]
    for index, scene in enumerate(make_scenes(32, seed=2)):
        shape_shares = torch.from_numpy(scene.shape_region(64).reshape(8, 8, 8, 8).mean((1, 3))).float()
        assert torch.allclose(with_shapes[index] - kind_maps[index], 0.5 * shape_shares)
        assert shape_shares.max() > 0


def test_reads_the_training_clips_and_their_reversals():
    for clip in make_clips(6, seed=3):
        frames = clip.draw()
        prompt = clip.motion.caption()
        assert all(judge_clip(frames, prompt).values()), prompt
        backwards = judge_clip(frames[::-1], prompt)
        assert backwards == {"shape": True, "colour": True, "direction": False, "background": True}
        still = np.repeat(frames[:1], len(frames), axis=0)
        assert judge_clip(still, prompt)["direction"] is False
        other = next(kind for kind in SHAPES if kind != clip.motion.kind)
        assert judge_clip(frames, prompt.replace(clip.motion.kind, other))["shape"] is False
