"""``paradiff-tiny-video``: its clips and their training batches, its shipped weights and that it follows prompts (its
training script is tested in test_motion_train.py)."""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AnimateDiffSDXLPipeline
from scene_analysis import motion_misses

from paradiff.builtin import DEFAULT_SIZE, FRAMES, VIDEO_EXAMPLE_PROMPTS, WEIGHTS, call_kwargs, pipeline_folder
from paradiff.builtin.clip_batches import (
    BAND_SHARE,
    DATASET_CLIPS,
    NOISE_BANDS,
    VIDEO_BATCH,
    kind_maps,
    shape_maps,
    video_batches,
)
from paradiff.builtin.clips import (
    DIRECTION_TOKENS,
    DIRECTIONS,
    MOTION_WORDS,
    TEST_MOTIONS,
    TEST_PROMPTS,
    make_clips,
    middle_clip,
)
from paradiff.builtin.configs import build_tokenizer
from paradiff.builtin.follow import judge_clip, rates
from paradiff.builtin.motion_train import ALPHAS_CUMPROD, colour_error
from paradiff.builtin.scenes import COLOURS, SHAPES, SIZES
from paradiff.builtin.train import KIND_WEIGHT, token_ids
from paradiff.builtin.vocabulary import unknown_words, warn_unknown_words
from paradiff.errors import ParadiffWarning
from paradiff.loading import load_pipeline

#: Where the video prompts are quoted: the README's video command and the built-in models' page.
DOCS = [Path(__file__).resolve().parents[1] / name for name in ("README.md", "docs/builtin-models.md")]


def draw(pipe, prompt: str, seed: int, steps: int = 20, size: int = DEFAULT_SIZE["video"], **extra) -> np.ndarray:
    """One clip ``(F, H, W, 3)`` in [0, 1], as ``paradiff generate`` asks the built-in video model for it."""
    generator = torch.Generator().manual_seed(seed)
    kwargs = call_kwargs("video", prompt, warn=False) | extra
    result = pipe(**kwargs, num_inference_steps=steps, height=size, width=size, output_type="np", generator=generator)
    return np.asarray(result.frames[0])


def test_clips_are_reproducible_and_captions_use_the_vocabulary():
    first, second = make_clips(40, seed=3), make_clips(40, seed=3)
    assert first == second and first != make_clips(40, seed=4)
    for clip in first:
        assert not unknown_words(clip.caption, kind="video"), clip.caption
        assert sum(phrase in clip.caption for phrase in DIRECTIONS) == 1, clip.caption
        assert clip.reversed().reversed() == clip and clip.reversed().caption != clip.caption


def test_the_test_prompts_are_held_out_of_training():
    """Every colour in every direction, and no training clip (nor its reversal) shows any of them."""
    assert len(set(TEST_PROMPTS)) == 24
    assert {(m.colour, m.direction) for m in TEST_MOTIONS} == {(c, d) for c in COLOURS for d in DIRECTIONS}
    for clip in make_clips(DATASET_CLIPS, seed=0):
        assert clip.motion not in TEST_MOTIONS and clip.motion.reversed() not in TEST_MOTIONS, clip.caption


def test_the_analysis_reads_drawn_clips_correctly():
    for clip in make_clips(12, seed=5):
        frames = clip.draw(128)
        assert frames.shape == (FRAMES, 128, 128, 3)
        assert motion_misses(frames, clip.motion.caption()) == [], clip.caption
        assert motion_misses(frames[::-1], clip.motion.caption()), "played backwards, it moves the other way"
        still = np.repeat(frames[:1], FRAMES, axis=0)
        assert motion_misses(still, clip.motion.caption()), "a shape that does not move does not follow"


def test_the_middle_clip_of_each_held_out_motion_is_drawn_as_its_prompt_asks():
    for motion in TEST_MOTIONS:
        assert all(judge_clip(middle_clip(motion).draw(128), motion.caption()).values()), motion.caption()


def test_unknown_words_for_the_video_model_include_no_motion_word():
    prompt = VIDEO_EXAMPLE_PROMPTS[0]
    assert unknown_words(prompt, kind="video") == []
    assert unknown_words(prompt) == ["moving", "from", "to"], "the picture models do not know them"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_unknown_words("a big red circle moving from left to right", kind="video") == ["big"]
    assert unknown_words("a red circle moving to the left", kind="video") == ["to"], "phrases are wholes"
    (message,) = [str(w.message) for w in caught if w.category is ParadiffWarning]
    assert "moving from top to bottom" in message and VIDEO_EXAMPLE_PROMPTS[0] in message and "'large'" in message
    assert call_kwargs("video", prompt, warn=False) == {"prompt": prompt, "guidance_scale": 2.0}


def test_a_clips_kind_regions_follow_its_shape_frame_by_frame():
    """Each frame's kind region lies around the shape where that frame draws it, and is where the kinds differ:
    none of it inside the shape's inner disc (every kind covers it) or far from the shape (none does)."""
    for clip in make_clips(6, seed=2):
        regions = clip.kind_regions(128)
        assert regions.shape == (FRAMES, 128, 128)
        radius = SIZES[clip.motion.size] * 128 / 2
        ys, xs = np.mgrid[:128, :128]
        for index, region in enumerate(regions):
            x, y = (128 * f for f in clip.centre(index))
            distance = np.hypot(xs - x, ys - y)
            assert region.any() and not region[distance < 0.35 * radius].any(), clip.caption
            assert not region[distance > 1.5 * radius].any(), clip.caption
            shape = clip.shape_regions(128)[index]
            assert shape[distance < 0.35 * radius].all() and not shape[distance > 1.5 * radius].any(), clip.caption
            assert shape[region].all(), "the kind region lies in the shape region"


def test_the_tuning_weighs_the_loss_up_on_the_kind_regions_reversed_with_the_clip():
    clips = make_clips(2, seed=0)
    latents = torch.zeros(len(clips), 4, FRAMES, 16, 16)
    maps = kind_maps(clips, 128, 16)
    assert maps.shape == (2, 1, FRAMES, 16, 16) and 0 < maps.mean() < 0.2
    shapes = torch.stack([torch.from_numpy(clip.shape_regions(128)).float() for clip in clips])[:, None]
    shape_share = (kind_maps(clips, 128, 16, shape_share=0.5) - maps) / 0.5
    torch.testing.assert_close(shape_share, torch.nn.functional.adaptive_avg_pool3d(shapes, (FRAMES, 16, 16)))
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    batches = video_batches(latents, clips, tokenizer, torch.Generator().manual_seed(0), "high", maps)
    expected = {}
    for clip, kind_map in zip(clips, maps, strict=True):
        for caption, frames in ((clip.caption, kind_map), (clip.reversed().caption, kind_map.flip(1))):
            expected[tuple(token_ids(tokenizer, [caption])[0][0].tolist())] = 1 + KIND_WEIGHT * frames
    seen = 0
    for _ in range(8):
        _, _, _, ids, _, weights, shapes = next(batches)
        assert shapes is None, "no shape maps asked"
        for row, weight in zip(ids.tolist(), weights, strict=True):
            if tuple(row) in expected:  # else its caption was dropped
                assert torch.equal(weight, expected[tuple(row)])
                seen += 1
    assert seen >= 16
    assert next(video_batches(latents, clips, tokenizer, torch.Generator()))[-2] is None, "an even loss"


def test_the_colour_tuning_draws_small_shapes_by_their_chance_with_their_shape_maps_where_a_colour_is_asked():
    clips = make_clips(12, seed=0)
    latents = torch.zeros(len(clips), 4, FRAMES, 16, 16)
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    maps = shape_maps(clips, 128, 16)
    expected_map, size_of = {}, {}
    for clip, shape_map in zip(clips, maps, strict=True):
        for caption, frames in ((clip.caption, shape_map), (clip.reversed().caption, shape_map.flip(1))):
            key = tuple(token_ids(tokenizer, [caption])[0][0].tolist())
            expected_map[key], size_of[key] = frames, clip.motion.size

    def small_share(chances) -> float:
        generator = torch.Generator().manual_seed(2)
        batches = video_batches(latents, clips, tokenizer, generator, "high", None, chances, maps)
        drawn = dropped = 0
        sizes = []
        for _ in range(60):
            _, _, _, ids, _, _, shapes = next(batches)
            for row, shape in zip(ids.tolist(), shapes, strict=True):
                drawn += 1
                if tuple(row) in expected_map:
                    assert torch.equal(shape, expected_map[tuple(row)]), "the drawn clip's map, reversed with it"
                    sizes.append(size_of[tuple(row)])
                else:  # its caption was dropped: no colour was asked
                    assert not shape.any()
                    dropped += 1
        assert 0 < dropped < 0.25 * drawn
        return sizes.count("small") / len(sizes)

    small = sum(clip.motion.size == "small" for clip in clips) / len(clips)
    expected = 10 * small / (10 * small + 1 - small)
    assert 0.2 < small < 0.8 and expected > 0.7
    assert abs(small_share(None) - small) < 0.15
    assert small_share([10.0 if clip.motion.size == "small" else 1.0 for clip in clips]) > expected - 0.1


def test_the_colour_error_is_the_shape_regions_mean_error_on_the_clean_latents():
    """``colour_error``: the mean over each frame's shape region of the clean latents' error (v's, times
    sqrt(1 - alpha_bar)), squared; an error outside the region or in a clip whose map is empty costs nothing, and one
    spread as noise over the region (mean zero) costs nothing either, where the flat loss counts it."""
    target = torch.zeros(2, 4, FRAMES, 8, 8)
    shapes = torch.zeros(2, 1, FRAMES, 8, 8)
    shapes[0, :, :, 2:4, 2:4] = 1.0
    timesteps = torch.tensor([900, 900])
    scale = float((1 - ALPHAS_CUMPROD[900]).sqrt())
    off_hue = target.clone()
    off_hue[0, 1, :, 2:4, 2:4] = 0.5  # one channel off in every frame's region
    assert colour_error(off_hue, target, timesteps, shapes) == pytest.approx((0.5 * scale) ** 2 / 4, rel=1e-5)
    outside = target.clone()
    outside[0, :, :, 5:, 5:] = 3.0
    outside[1] = 3.0  # the second clip asked no colour
    assert colour_error(outside, target, timesteps, shapes) == 0
    noise = target.clone()
    noise[0, :, :, 2:4, 2:4] = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    assert colour_error(noise, target, timesteps, shapes) == pytest.approx(0, abs=1e-12)
    assert colour_error(off_hue, target, timesteps, torch.zeros_like(shapes)) == 0


def test_a_noise_band_draws_half_of_each_batch_in_it():
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    clips = make_clips(4, seed=0)
    latents = torch.zeros(len(clips), 4, FRAMES, 4, 4)

    def first_half(band: str | None) -> torch.Tensor:
        batches = video_batches(latents, clips, tokenizer, torch.Generator().manual_seed(1), band)
        return torch.stack([next(batches)[2][: int(BAND_SHARE * VIDEO_BATCH)] for _ in range(30)])

    even = first_half(None)
    for band, (low, high) in NOISE_BANDS.items():
        drawn = first_half(band)
        assert ((drawn >= low) & (drawn < high)).all(), band
        assert not ((even >= low) & (even < high)).all(), "an even draw spans the levels"


def test_shipped_video_model_is_small_and_loads_offline():
    folder = pipeline_folder("video")
    files = [path for part in (folder, folder / "vae") for path in part.resolve().rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) <= 25 * 2**20
    pipe = load_pipeline("paradiff-tiny-video")
    assert isinstance(pipe, AnimateDiffSDXLPipeline) and pipe.unet.config.motion_max_seq_length == FRAMES
    assert (folder / "vae").resolve() == (WEIGHTS / "sd" / "vae").resolve(), "the VAE is the pictures', linked"


@pytest.fixture(scope="module")
def video_pipe():
    pipe = load_pipeline("paradiff-tiny-video")
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: A quarter of the held-out prompts: every colour once, every shape once large and once small, every direction and
#: background (the first such set in the order of the 24, which are every colour in every direction, with shapes,
#: sizes and backgrounds taken in turn). The suite draws these, which takes about 13 s here.
CHECKED = (0, 4, 9, 14, 19, 23)
CHECKED_PROMPTS = tuple(TEST_PROMPTS[i] for i in CHECKED)


def test_the_checked_prompts_are_a_quarter_and_cover_every_colour_shape_size_and_direction():
    motions = [TEST_MOTIONS[i] for i in CHECKED]
    assert len(motions) == len(TEST_MOTIONS) // 4
    assert sorted(motion.colour for motion in motions) == sorted(COLOURS)
    assert sorted((motion.kind, motion.size) for motion in motions) == sorted(itertools.product(SHAPES, SIZES))
    assert {motion.direction for motion in motions} == set(DIRECTIONS)
    assert {motion.background for motion in motions} == {motion.background for motion in TEST_MOTIONS}


@pytest.mark.timeout(400)
def test_video_model_follows_held_out_prompts_in_colour_and_direction(video_pipe, report):
    """Each checked held-out prompt at the default size, seed 0, 8 steps (its default, for the suite's time): the
    asked colour is found and its centroid moves the asked way by at least 15% of the frame between the first and last
    quarter of the frames, in at least 75% of them. The follow measure's rates on the same clips are reported and held
    a little under the shipped model's (docs/builtin-models.md gives them)."""
    clips = {prompt: draw(video_pipe, prompt, seed=0, steps=8) for prompt in CHECKED_PROMPTS}
    misses = {prompt: motion_misses(frames, prompt) for prompt, frames in clips.items()}
    followed = [prompt for prompt, missed in misses.items() if not missed]
    measured = rates([judge_clip(frames, prompt) for prompt, frames in clips.items()])
    report(
        f"paradiff-tiny-video, {len(clips)} held-out clips: colour moves the asked way {len(followed)}; follow "
        "measure: " + ", ".join(f"{check} {100 * share:.0f}%" for check, share in measured.items())
    )
    assert len(followed) >= 0.75 * len(CHECKED_PROMPTS), {prompt: missed for prompt, missed in misses.items() if missed}
    floors = {"shape": 0.6, "colour": 0.6, "direction": 0.8, "background": 0.9}
    assert all(measured[check] >= floor for check, floor in floors.items()), measured


def test_readme_video_examples_are_the_checked_ones():
    text = "\n".join(path.read_text() for path in DOCS)
    quoted = dict.fromkeys(re.findall(r'"([a-z][a-z ]+ moving [a-z ]+)"', text))
    assert quoted, "neither README.md nor docs/builtin-models.md shows a video prompt"
    assert set(quoted) <= set(VIDEO_EXAMPLE_PROMPTS), set(quoted) - set(VIDEO_EXAMPLE_PROMPTS)
