"""The built-in ``paradiff-tiny`` pipelines: data, tokenizer, training script, shipped weights, prompt following."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, PixArtAlphaPipeline, StableDiffusionPipeline
from safetensors.torch import load_file
from scene_analysis import background_of, where_is

from paradiff.builtin import WEIGHTS
from paradiff.builtin.components import build_tokenizer
from paradiff.builtin.scenes import BACKGROUNDS, COLOURS, PLACES, SHAPES, SIZES, VOCABULARY, Shape, make_scenes
from paradiff.builtin.train import mirrored, train
from paradiff.loading import TRAINED_MODELS, load_pipeline, prompt_kwargs


def follow_prompts(count: int = 24) -> list[str]:
    """``count`` single-shape prompts, each a different colour/place pair, drawn with a fixed seed."""
    rng = random.Random(0)
    pairs = rng.sample([(colour, place) for colour in COLOURS for place in PLACES], count)
    return [
        Shape(rng.choice(SHAPES), colour, rng.choice(sorted(SIZES)), place).phrase(with_size=True)
        + f" on a {rng.choice(sorted(BACKGROUNDS))} background"
        for colour, place in pairs
    ]


def test_scenes_are_reproducible_and_captions_use_the_vocabulary():
    first, again = make_scenes(50, seed=3), make_scenes(50, seed=3)
    assert [s.caption for s in first] == [s.caption for s in again]
    np.testing.assert_array_equal(first[7].draw(), again[7].draw())
    words = {word for scene in first for word in scene.caption.split()}
    assert words <= set(VOCABULARY)
    assert any(" and " in scene.caption for scene in first), "two-shape scenes are part of the data"


def test_the_analysis_reads_drawn_scenes_correctly():
    for scene in make_scenes(60, seed=4):
        image = scene.draw()
        for shape in scene.shapes:
            assert where_is(image, shape.colour) == shape.place, scene.caption
        absent = next(colour for colour in COLOURS if colour not in {s.colour for s in scene.shapes})
        assert where_is(image, absent) is None


def test_mirrored_caption_swaps_left_and_right():
    scene = next(s for s in make_scenes(100, seed=1) if "left" in s.caption)
    assert "right" in mirrored(scene) and mirrored(scene).count("left") == scene.caption.count("right")


def test_tokenizer_knows_every_word_and_ignores_case_and_punctuation():
    tokenizer = build_tokenizer()
    ids = tokenizer(" ".join(VOCABULARY)).input_ids
    assert tokenizer.unk_token_id not in ids and len(set(ids)) == len(VOCABULARY) + 2  # + bos, eos
    assert tokenizer("A Red, circle.").input_ids == tokenizer("a red circle").input_ids
    assert tokenizer("a zebra").input_ids[2] == tokenizer.unk_token_id


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """The folder a short run of the training script wrote."""
    folder = tmp_path_factory.mktemp("short-run")
    train(folder, scale=0.002, seed=0)
    return folder


@pytest.mark.timeout(300)
def test_training_script_writes_pipelines_that_load_and_generate(short_run):
    sd = DiffusionPipeline.from_pretrained(short_run / "sd")
    pixart = DiffusionPipeline.from_pretrained(short_run / "pixart")
    assert isinstance(sd, StableDiffusionPipeline) and isinstance(pixart, PixArtAlphaPipeline)
    assert (short_run / "pixart" / "vae").is_symlink(), "the DiT pipeline shares the VAE instead of copying it"
    assert sd.unet.dtype == torch.float32, "float16 files load as float32 by default"
    for pipe, size in ((sd, 128), (pixart, 256)):
        image = pipe("a red circle", num_inference_steps=2, output_type="np").images
        assert image.shape == (1, size, size, 3) and np.isfinite(image).all()


@pytest.mark.timeout(300)
def test_reusing_a_runs_encoders_reproduces_its_denoisers(short_run, tmp_path):
    """``--encoders``: denoisers train on the float16-rounded encoders either way, so they come out bit-identical."""
    train(tmp_path, scale=0.002, seed=0, encoders=short_run / "sd")
    for denoiser in ("sd/unet", "pixart/transformer"):
        first, second = (load_file(next((folder / denoiser).glob("*.safetensors"))) for folder in (short_run, tmp_path))
        assert first.keys() == second.keys()
        assert all(torch.equal(first[name], second[name]) for name in first), f"{denoiser} differs"


def test_shipped_weights_are_small_and_load_offline():
    files = [path for path in WEIGHTS.rglob("*") if path.is_file() and not path.is_symlink()]
    assert sum(path.stat().st_size for path in files) <= 20 * 2**20
    assert isinstance(load_pipeline("paradiff-tiny"), StableDiffusionPipeline)
    assert isinstance(load_pipeline("paradiff-tiny-dit"), PixArtAlphaPipeline)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", list(TRAINED_MODELS))
def test_builtin_model_follows_prompts(model):
    """At least 80% of 24 prompts show the asked colour in the asked place, on the asked background.

    Each prompt names a different colour/place pair; a model that ignored the place would put the
    shape in the asked one of the nine cells about one time in nine. The pipelines are prompted as
    ``paradiff generate`` prompts them (at the built-in guidance scale).
    """
    pipe = load_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    backgrounds, places = [], []
    for seed, prompt in enumerate(follow_prompts()):
        inputs = prompt_kwargs(pipe, model, prompt)
        image = pipe(**inputs, num_inference_steps=20, generator=torch.Generator().manual_seed(seed), output_type="np")
        colour = next(word for word in prompt.split() if word in COLOURS)
        place = next(phrase for phrase in PLACES if f"{phrase} on a" in prompt)
        background = next(name for name in BACKGROUNDS if f"on a {name} background" in prompt)
        backgrounds.append(background_of(image.images[0]) == background)
        places.append(where_is(image.images[0], colour) == place)
    rates = f"background {sum(backgrounds)}, colour in place {sum(places)} of {len(places)}"
    assert len(places) >= 20 and np.mean(places) >= 0.8 and np.mean(backgrounds) >= 0.8, rates


def test_missing_weights_say_how_to_rebuild(monkeypatch, tmp_path):
    import paradiff.builtin as builtin

    monkeypatch.setattr(builtin, "WEIGHTS", Path(tmp_path))
    with pytest.raises(Exception, match="python -m paradiff.builtin.train"):
        builtin.pipeline_folder("sd")
