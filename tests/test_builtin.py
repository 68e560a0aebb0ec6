"""The built-in ``paradiff-tiny`` pipelines: data, tokenizer, training script, shipped weights, prompt following."""

from __future__ import annotations

import json
import random
import re
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline, PixArtAlphaPipeline, StableDiffusionPipeline
from scene_analysis import asked_by, misses, where_is
from training_runs import as_the_script, weights_in

from paradiff.builtin import DEFAULT_SIZE, EXAMPLE_PROMPTS, WEIGHTS, call_kwargs, unknown_words, warn_unknown_words
from paradiff.builtin.configs import build_dit, build_tokenizer, build_vae
from paradiff.builtin.follow import judge, rates
from paradiff.builtin.scenes import (
    BACKGROUNDS,
    COLOURS,
    HELD_OUT_PROMPTS,
    PLACES,
    SHAPES,
    VOCABULARY,
    asked_scene,
    make_scenes,
)
from paradiff.builtin.train import (
    VAE_CONTRAST_MARGIN,
    contrast_shortfall,
    mirrored,
    train,
    train_vae,
    vae_views,
    view_shape_regions,
    with_written_weights,
)
from paradiff.builtin.vocabulary import KNOWN_WORDS, SUGGESTIONS
from paradiff.errors import ParadiffError, ParadiffWarning
from paradiff.loading import TRAINED_MODELS, load_pipeline, prompt_kwargs

#: The picture models (the video model has its own tests, in test_builtin_video.py).
PICTURE_MODELS = [model for model, kind in TRAINED_MODELS.items() if kind != "video"]


def draw_each(pipe, calls: list[dict], seeds, size: int | None = None, batch: int = 12) -> list[np.ndarray]:
    """The picture of each call (its keyword arguments, and its seed), 20 steps, drawn ``batch`` calls at a time.

    The pipelines draw each batch entry's noise from that entry's generator, so each picture is the one its own
    call draws, within float round-off; a batch costs a fraction of its calls one by one on a CPU.
    """
    shared = {name: value for name, value in calls[0].items() if name != "prompt"}
    assert all({name: value for name, value in call.items() if name != "prompt"} == shared for call in calls)
    sizes = {} if size is None else {"height": size, "width": size}
    seeds = list(seeds)
    images = []
    for start in range(0, len(calls), batch):
        images += list(
            pipe(
                **shared,
                **sizes,
                prompt=[call["prompt"] for call in calls[start : start + batch]],
                generator=[torch.Generator().manual_seed(seed) for seed in seeds[start : start + batch]],
                num_inference_steps=20,
                output_type="np",
            ).images
        )
    return images


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


def test_the_asked_scene_of_each_held_out_prompt_is_drawn_as_it_asks_and_a_prompt_without_its_size_is_refused():
    for prompt in HELD_OUT_PROMPTS:
        assert all(judge(asked_scene(prompt).draw(), prompt).values()), prompt
    with pytest.raises(ValueError, match="size and background"):
        asked_scene("a red circle at the top on a white background")


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
    as_the_script(train, folder, scale=0.001, seed=0)
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
    as_the_script(train, tmp_path, scale=0.001, seed=0, encoders=short_run / "sd")
    for denoiser in ("sd/unet", "pixart/transformer"):
        first, second = (weights_in(folder / denoiser) for folder in (short_run, tmp_path))
        assert first.keys() == second.keys()
        assert all(torch.equal(first[name], second[name]) for name in first), f"{denoiser} differs"


@pytest.mark.timeout(300)
def test_a_stopped_dit_stage_resumes_to_the_weights_of_an_unbroken_run(short_run, tmp_path, monkeypatch):
    """``--encoders --denoisers dit --checkpoints``: stopped after its 3rd step, the stage resumes from the state
    saved at step 2 and ends with the DiT the short run's unbroken stage wrote (same seed, same encoders)."""
    import paradiff.builtin.train as training

    monkeypatch.setattr(training, "CHECKPOINT_EVERY", 2)
    unbroken = training.denoiser_batches

    def stopping(*args):
        for index, batch in enumerate(unbroken(*args)):
            if index == 3:
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(training, "denoiser_batches", stopping)
    args = dict(out=tmp_path / "out", scale=0.001, seed=0, encoders=short_run / "sd", denoisers=("dit",))
    with pytest.raises(KeyboardInterrupt):
        as_the_script(train, **args, checkpoints=tmp_path / "state")
    assert torch.load(tmp_path / "state" / "dit.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(training, "denoiser_batches", unbroken)
    as_the_script(train, **args, checkpoints=tmp_path / "state")
    runs = (short_run, args["out"])
    first, second = (weights_in(run / "pixart/transformer") for run in runs)
    assert all(torch.equal(first[name], second[name]) for name in first), "the resumed DiT differs"
    assert (args["out"] / "sd" / "vae").is_dir(), "the encoders' folder is copied beside the new pixart/"


@pytest.mark.timeout(300)
def test_the_training_script_trains_a_dit_of_another_patch_size_for_the_steps_asked(short_run, tmp_path, monkeypatch):
    """``--dit-patch 2 --dit-steps 3 --dit-tune 2``: the DiT has 2x2-latent patches, was trained 3 steps and then
    tuned 2 (the saved states say so), the DiT written is the tuning's moving average of the weights, not the
    weights, and its pipeline draws at the training size."""
    import paradiff.builtin.train as training

    monkeypatch.setattr(training, "CHECKPOINT_EVERY", 1)
    out, state = tmp_path / "out", tmp_path / "state"
    training.main(
        ["--out", str(out), "--scale", "0.001", "--encoders", str(short_run / "sd"), "--denoisers", "dit"]
        + ["--dit-patch", "2", "--dit-steps", "3", "--dit-tune", "2", "--checkpoints", str(state)]
    )
    assert torch.load(state / "dit.pt", weights_only=False)["step"] == 3
    tuned = torch.load(state / "dit-tune.pt", weights_only=False)
    assert tuned["step"] == 2
    written = weights_in(out / "pixart" / "transformer")
    assert all(torch.equal(written[name], tuned["average"][name].half()) for name in written)
    assert not all(torch.equal(written[name], tuned["dit"][name].half()) for name in written)
    pixart = DiffusionPipeline.from_pretrained(out / "pixart")
    assert pixart.transformer.config.patch_size == 2
    image = pixart("a red circle", num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 256, 256, 3) and np.isfinite(image).all()


@pytest.mark.timeout(300)
def test_the_training_script_tunes_the_unet_and_writes_its_moving_average(short_run, tmp_path, monkeypatch):
    """``--denoisers unet --unet-tune 2 --shape-weight 5``: the U-Net stage saves its state (the short run's U-Net:
    same seed, same encoders), then 2 tuning steps on maps with the shape region at half the kind region's weight;
    the U-Net written is the tuning's moving average of the weights."""
    import paradiff.builtin.train as training

    monkeypatch.setattr(training, "CHECKPOINT_EVERY", 1)
    encode, shares = training.encode_dataset, []
    monkeypatch.setattr(training, "encode_dataset", lambda *args: shares.append(args[-1]) or encode(*args))
    out, state = tmp_path / "out", tmp_path / "state"
    training.main(
        ["--out", str(out), "--scale", "0.001", "--encoders", str(short_run / "sd"), "--denoisers", "unet"]
        + ["--unet-tune", "2", "--shape-weight", "5", "--checkpoints", str(state)]
    )
    assert shares == [5 / training.KIND_WEIGHT], "only the U-Net's data, its maps with the shape share asked"
    trained = torch.load(state / "unet.pt", weights_only=False)
    unbroken = weights_in(short_run / "sd" / "unet")
    assert all(torch.equal(unbroken[name], trained["unet"][name].half()) for name in unbroken)
    tuned = torch.load(state / "unet-tune.pt", weights_only=False)
    assert tuned["step"] == 2
    written = weights_in(out / "sd" / "unet")
    assert all(torch.equal(written[name], tuned["average"][name].half()) for name in written)
    assert not all(torch.equal(written[name], unbroken[name]) for name in written), "the tuning changed nothing"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("denoiser", "folder"), [("dit", "pixart/transformer"), ("unet", "sd/unet")])
def test_tuning_from_a_written_model_goes_on_from_its_denoiser(short_run, tmp_path, monkeypatch, denoiser, folder):
    """``--tune-from DIR --denoisers dit --dit-tune 2`` (and the U-Net's): no training stage runs; the tuning stage
    starts from DIR's denoiser (2 steps move it by little, where a fresh one would differ wholly), at the lower
    learning rate, and the denoiser written is its moving average, with DIR's config."""
    import paradiff.builtin.train as training

    monkeypatch.setattr(training, "CHECKPOINT_EVERY", 1)
    out, state = tmp_path / "out", tmp_path / "state"
    training.main(
        ["--out", str(out), "--scale", "0.001", "--encoders", str(short_run / "sd"), "--denoisers", denoiser]
        + ["--tune-from", str(short_run), f"--{denoiser}-tune", "2", "--checkpoints", str(state)]
    )
    assert sorted(path.name for path in state.iterdir()) == [f"{denoiser}-retune.pt"], "only a tuning stage ran"
    tuned = torch.load(state / f"{denoiser}-retune.pt", weights_only=False)
    assert tuned["step"] == 2
    peak = training.TUNE_LR * training.RETUNE_LR_SHARE
    assert training.RETUNE_LR_SHARE < 1 and tuned["optimizer"]["param_groups"][0]["lr"] == training.lr_at(1, 2, peak)
    started = weights_in(short_run / folder)
    moved = max(float((tuned[denoiser][name] - started[name].float()).abs().max()) for name in started)
    assert 0 < moved < 1e-4, moved
    written = weights_in(out / folder)
    assert all(torch.equal(written[name], tuned["average"][name].half()) for name in written)
    config = f"{folder}/config.json"
    assert (out / config).read_text() == (short_run / config).read_text(), "the config names no folder"


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        ([], "give --dit-tune N, or leave dit out of --denoisers"),
        (["--dit-tune", "2", "--dit-steps", "5"], "--tune-from skips the DiT's training stage"),
    ],
)
def test_tuning_from_a_written_model_refuses_what_it_cannot_run(short_run, tmp_path, capsys, extra, refusal):
    import paradiff.builtin.train as training

    with pytest.raises(SystemExit):
        training.main(
            ["--out", str(tmp_path), "--encoders", str(short_run / "sd"), "--denoisers", "dit"]
            + ["--tune-from", str(short_run), *extra]
        )
    assert refusal in capsys.readouterr().err
    with pytest.raises(SystemExit):
        training.main(["--out", str(tmp_path), "--tune-from", str(short_run), "--dit-tune", "2", "--unet-tune", "2"])
    assert "--tune-from need --encoders" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


@pytest.mark.timeout(300)
def test_a_wider_dit_is_trained_and_tuned_again_at_its_width(short_run, tmp_path):
    """``--dit-width``: the DiT written has that many 32-wide heads, and ``--tune-from`` it builds the same width
    (not the default's, whose weights would not fit)."""
    import paradiff.builtin.train as training

    denoiser = ["--encoders", str(short_run / "sd"), "--denoisers", "dit", "--scale", "0.001"]
    training.main(["--out", str(tmp_path / "wide"), *denoiser, "--dit-width", "96"])
    config = json.loads((tmp_path / "wide" / "pixart" / "transformer" / "config.json").read_text())
    assert (config["num_attention_heads"], config["attention_head_dim"], config["cross_attention_dim"]) == (3, 32, 96)
    training.main(
        ["--out", str(tmp_path / "tuned"), *denoiser, "--tune-from", str(tmp_path / "wide"), "--dit-tune", "2"]
    )
    tuned = weights_in(tmp_path / "tuned" / "pixart" / "transformer")
    assert tuned["caption_projection.linear_1.weight"].shape == (96, 64)  # width x text width


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--dit-width", "100"], "argument --dit-width: 100 is not a multiple of the 32-wide heads; e.g. 256"),
        (["--dit-width", "0"], "argument --dit-width: 0 is not a multiple of the 32-wide heads"),
        (["--dit-width", "wide"], "argument --dit-width: 'wide' is no number; give one, e.g. 256"),
        (["--tune-from", "DIR", "--dit-tune", "2", "--dit-width", "96"], "--tune-from keeps the written DiT's width"),
        (["--tune-from", "DIR", "--dit-tune", "2", "--dit-width", "128"], "--tune-from keeps the written DiT's width"),
    ],
)
def test_the_training_script_refuses_a_dit_width_it_cannot_build(short_run, tmp_path, capsys, flags, refusal):
    import paradiff.builtin.train as training

    with pytest.raises(SystemExit):
        training.main(["--out", str(tmp_path), "--encoders", str(short_run / "sd"), "--denoisers", "dit", *flags])
    assert refusal in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


@pytest.mark.timeout(300)
def test_the_decoder_tuning_rewrites_a_folders_decoder_alone_in_place(short_run, tmp_path):
    """The documented form, ``--out DIR --encoders DIR/sd --denoisers --decoder-tune 2`` (and ``--scale 0.001``, which
    here only shortens the round trip it logs): DIR/sd/vae is replaced by a VAE (same config) whose decoder moved and
    whose encoder (what the denoisers learned from) did not; nothing else changes, and ``pixart/`` still links to it."""
    import shutil

    import paradiff.builtin.train as training

    folder = tmp_path / "tiny"
    shutil.copytree(short_run, folder, symlinks=True)
    decoder_only = ["--encoders", str(folder / "sd"), "--denoisers", "--decoder-tune", "2", "--scale", "0.001"]
    training.main(["--out", str(folder), *decoder_only])
    before, after = (weights_in(run / "sd" / "vae") for run in (short_run, folder))
    assert before.keys() == after.keys()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert any(name.startswith("decoder.") for name in moved), "the decoder did not move"
    assert all(name.startswith(("decoder.", "post_quant_conv.")) for name in moved), sorted(
        name for name in moved if not name.startswith("decoder.")
    )[:4]
    for part in ("sd/unet", "sd/text_encoder", "pixart/transformer"):
        first, second = (weights_in(run / part) for run in (short_run, folder))
        assert all(torch.equal(first[name], second[name]) for name in first), f"{part} changed"
    assert (folder / "sd" / "vae" / "config.json").read_text() == (short_run / "sd" / "vae" / "config.json").read_text()
    assert (folder / "pixart" / "vae").is_symlink() and (folder / "pixart" / "vae").resolve() == folder / "sd" / "vae"


def test_the_training_script_refuses_a_run_that_trains_nothing(short_run, tmp_path, capsys):
    import paradiff.builtin.train as training

    with pytest.raises(SystemExit):
        training.main(["--out", str(tmp_path), "--encoders", str(short_run / "sd"), "--denoisers"])
    assert "nothing to train" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


@pytest.mark.parametrize(
    ("weight", "refusal"),
    [("-5", "-5 is below 0; give 0 (no extra weight) or more"), ("much", "'much' is no number")],
)
def test_the_training_script_refuses_a_shape_weight_that_is_no_weight(tmp_path, capsys, weight, refusal):
    import paradiff.builtin.train as training

    with pytest.raises(SystemExit):
        training.main(["--out", str(tmp_path), "--shape-weight", weight])
    assert f"argument --shape-weight: {refusal}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_the_contrast_shortfall_is_the_margin_squared_for_latents_blind_to_shapes_and_zero_for_ones_showing_them():
    views = vae_views(random.Random(2))
    regions = F.adaptive_avg_pool2d(view_shape_regions(views), 16)
    assert any(len(scene.shapes) == 1 for scene, _, _ in views)
    blind = torch.randn(len(views), 4, 1, 1, generator=torch.Generator().manual_seed(0)).expand(-1, -1, 16, 16)
    assert contrast_shortfall(views, blind) == pytest.approx(VAE_CONTRAST_MARGIN**2)
    showing = regions.expand(-1, 4, -1, -1) + 0.01 * blind
    assert contrast_shortfall(views, showing) == 0
    two_shapes = [view for view in vae_views(random.Random(5)) if len(view[0].shapes) == 2]
    assert contrast_shortfall(two_shapes, blind[: len(two_shapes)]) == 0, "no one-shape view: nothing to count"


def test_the_vae_stage_trains_on_the_contrast_term_only_when_asked(monkeypatch):
    """Batches of 4 views (2 crops, 2 whole scenes; one-shape ones among them), half the stage's work."""
    import paradiff.builtin.train as training

    monkeypatch.setattr(training, "VAE_BATCH", 4)
    trained = {}
    for contrast in (0.0, 0.0, 50.0):
        torch.manual_seed(0)
        vae = build_vae()
        train_vae(vae, 2, seed=3, contrast=contrast)
        trained.setdefault(contrast, []).append(vae.encoder.conv_in.weight.detach().clone())
    assert torch.equal(*trained[0.0]), "seeded: the same run twice gives the same weights"
    assert not torch.equal(trained[0.0][0], trained[50.0][0])


def test_the_training_script_refuses_a_vae_contrast_beside_a_reused_vae(short_run, tmp_path, capsys):
    import paradiff.builtin.train as training

    with pytest.raises(SystemExit):
        training.main(["--out", str(tmp_path), "--encoders", str(short_run / "sd"), "--vae-contrast", "1"])
    assert "--vae-contrast weighs the VAE's training, and --encoders reuses a trained VAE" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_weights_of_another_shape_are_refused_naming_what_differs_and_the_fix(tmp_path):
    """Not torch's list of every size mismatch: a run going on from a folder built from other parts (the video
    script's ``--tune-from`` beside another ``--pictures``) is told which."""
    torch.manual_seed(0)
    written = build_dit(4)
    written.save_pretrained(tmp_path)
    loaded = with_written_weights(build_dit(4), tmp_path).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in written.state_dict().items())
    with pytest.raises(ParadiffError) as refused:
        with_written_weights(build_dit(2), tmp_path, "give the --pictures folder it was trained from")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path} holds another PixArtTransformer2DModel than this run builds: "), message
    assert " there, " in message and message.endswith("here; give the --pictures folder it was trained from"), message


def test_the_dit_tuning_draws_half_its_batches_at_high_noise():
    """Uniform timesteps below :data:`TUNE_HIGH_FROM` and above it, in the shares the tuning stage asks for."""
    from paradiff.builtin.train import TUNE_HIGH_FROM, TUNE_HIGH_SHARE, denoiser_batches

    latents, captions = torch.zeros(4, 4, 8, 8), ["a red circle"] * 4
    for high_noise, share in ((False, 0.5), (True, TUNE_HIGH_SHARE + (1 - TUNE_HIGH_SHARE) / 2)):
        batches = denoiser_batches(latents, captions, build_tokenizer(), torch.Generator().manual_seed(0), high_noise)
        timesteps = torch.cat([next(batches)[2] for _ in range(200)])
        assert timesteps.min() >= 0 and timesteps.max() <= 999
        assert abs((timesteps >= TUNE_HIGH_FROM).float().mean() - share) < 0.03


def test_the_kind_region_is_where_a_circle_a_square_and_a_triangle_differ():
    """Inside all three kinds (the centre) and outside all three (the background): not in it; a square's corner,
    which neither the circle nor the triangle covers: in it."""
    from paradiff.builtin.scenes import SIZES, Scene, Shape

    scene = Scene((Shape("circle", "red", "large", "in the center"),), "white", "a red circle", ((0.0, 0.0),))
    region, r = scene.kind_region(256), SIZES["large"] * 256 / 2
    assert not region[128, 128] and not region[5, 5] and not region[128, 128 + round(1.3 * r)]
    corner = 128 + round(0.85 * r)
    assert region[corner, corner] and region[128 - round(0.95 * r), 128]
    assert 0.02 < region.mean() < 0.12


def test_the_shape_region_is_where_a_shape_of_any_kind_would_show():
    """The centre and a square's corner (which only the square covers) are in it; the background and a point
    just past the circle's side are not; it holds the whole kind region."""
    from paradiff.builtin.scenes import SIZES, Scene, Shape

    scene = Scene((Shape("square", "red", "large", "in the center"),), "white", "a red square", ((0.0, 0.0),))
    region, r = scene.shape_region(256), SIZES["large"] * 256 / 2
    corner = 128 + round(0.85 * r)
    assert region[128, 128] and region[corner, corner]
    assert not region[5, 5] and not region[128, 128 + round(1.1 * r)]
    assert np.all(region >= scene.kind_region(256)) and region.sum() > scene.kind_region(256).sum()


def test_the_tuning_batches_weigh_each_latent_by_its_own_kind_map():
    """The weights of a drawn latent are 1 + KIND_WEIGHT x that latent's map (told apart by its caption's colour),
    and None without maps; the weighted loss counts an error in the region that many times one outside."""
    from paradiff.builtin.train import KIND_WEIGHT, denoiser_batches, weighted_mse

    tokenizer, colours = build_tokenizer(), sorted(COLOURS)
    captions = [f"a {colour} circle" for colour in colours]
    maps = torch.rand(len(colours), 1, 8, 8)
    batches = denoiser_batches(torch.zeros(len(colours), 4, 8, 8), captions, tokenizer, torch.Generator(), True, maps)
    checked = 0
    for _ in range(5):
        *_, ids, _, weights = next(batches)
        for row, weight in zip(ids, weights, strict=True):
            named = [colour for colour in colours if tokenizer.convert_tokens_to_ids(colour) in row.tolist()]
            if named:
                assert torch.equal(weight, 1 + KIND_WEIGHT * maps[colours.index(named[0])])
                checked += 1
    assert checked > 40
    plain = denoiser_batches(torch.zeros(2, 4, 8, 8), captions[:2], tokenizer, torch.Generator(), True)
    assert next(plain)[-1] is None

    target, inside = torch.zeros(1, 1, 2, 2), torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]]])
    weights = 1 + KIND_WEIGHT * inside
    error_inside, error_outside = inside.clone(), torch.tensor([[[[0.0, 1.0], [0.0, 0.0]]]])
    ratio = weighted_mse(error_inside, target, weights) / weighted_mse(error_outside, target, weights)
    assert ratio == pytest.approx(1 + KIND_WEIGHT)
    assert weighted_mse(error_inside, target, None) == pytest.approx(0.25)
    assert weighted_mse(error_inside, target, torch.full_like(target, 3.0)) == pytest.approx(0.25)


def test_shipped_weights_are_small_and_load_offline():
    pictures = [path for path in WEIGHTS.rglob("*") if path.is_file() and path.relative_to(WEIGHTS).parts[0] != "video"]
    assert sum(path.stat().st_size for path in pictures) <= 20 * 2**20
    assert isinstance(load_pipeline("paradiff-tiny"), StableDiffusionPipeline)
    assert isinstance(load_pipeline("paradiff-tiny-dit"), PixArtAlphaPipeline)


#: The least share of the held-out pictures each picture model gets right, per check of the follow measure, a
#: little under what the shipped weights reach (docs/builtin-models.md gives the rates).
FOLLOW_FLOORS = {
    "paradiff-tiny": {"shape": 0.85, "colour": 0.75, "place": 0.9, "background": 0.9},
    "paradiff-tiny-dit": {"shape": 0.75, "colour": 0.75, "place": 0.9, "background": 0.9},
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", PICTURE_MODELS)
def test_builtin_model_follows_held_out_prompts(model, report):
    """24 held-out prompts x seeds 0 and 1 at the default size, each picture read by the follow measure.

    The pipelines are prompted as ``paradiff generate`` prompts them; every rate is reported in the run's
    summary, whatever the outcome.
    """
    pipe = load_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    drawn = [(prompt, seed) for prompt in HELD_OUT_PROMPTS for seed in (0, 1)]
    calls = [prompt_kwargs(pipe, model, prompt) for prompt, _ in drawn]
    images = draw_each(pipe, calls, [seed for _, seed in drawn], DEFAULT_SIZE[TRAINED_MODELS[model]])
    measured = rates([judge(image, prompt) for image, (prompt, _) in zip(images, drawn, strict=True)])
    line = f"{model}, {len(images)} held-out pictures: " + ", ".join(
        f"{check} {100 * share:.0f}%" for check, share in measured.items()
    )
    report(line)
    assert all(measured[check] >= floor for check, floor in FOLLOW_FLOORS[model].items()), line


#: Where the built-in prompts are quoted: the README's first command and the built-in models' page.
DOCS = [Path(__file__).resolve().parents[1] / name for name in ("README.md", "docs/builtin-models.md")]


def readme_prompts(text: str) -> list[str]:
    """Every quoted prompt in ``text`` written in the built-in model's words (with a shape): its examples."""
    quoted = dict.fromkeys(re.findall(r'"([a-z][a-z ]+)"', text))
    return [prompt for prompt in quoted if not unknown_words(prompt) and set(prompt.split()) & set(SHAPES)]


def test_readme_examples_are_the_checked_ones():
    """The README and docs/builtin-models.md show only prompts the prompt-following test below draws (and some)."""
    shown = readme_prompts("\n".join(path.read_text() for path in DOCS))
    assert shown, "neither README.md nor docs/builtin-models.md shows a built-in prompt"
    assert set(shown) <= set(EXAMPLE_PROMPTS), (
        f"not in paradiff.builtin.EXAMPLE_PROMPTS: {set(shown) - set(EXAMPLE_PROMPTS)}"
    )
    assert readme_prompts('"a big red circle" and "a red circle on the left" or paradiff generate "..."') == [
        "a red circle on the left"
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", PICTURE_MODELS)
def test_example_prompts_are_followed(model):
    """Each shown example at the pipeline's default size, seeds 0 and 1: asked colours in place, asked background."""
    kind = TRAINED_MODELS[model]
    pipe = load_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    size = DEFAULT_SIZE[kind]
    for prompt in EXAMPLE_PROMPTS:
        assert not unknown_words(prompt) and asked_by(prompt)[1] is not None, prompt
    drawn = [(prompt, seed) for prompt in EXAMPLE_PROMPTS for seed in (0, 1)]
    images = draw_each(pipe, [call_kwargs(kind, prompt) for prompt, _ in drawn], [seed for _, seed in drawn], size)
    assert all(image.shape == (size, size, 3) for image in images)
    wrong = {
        f"{prompt!r}, seed {seed}": misses(image, prompt) for (prompt, seed), image in zip(drawn, images, strict=True)
    }
    assert not any(wrong.values()), {name: missed for name, missed in wrong.items() if missed}


def test_misses_reads_what_a_prompt_asks_for():
    scene = next(s for s in make_scenes(200, seed=5) if len(s.shapes) == 2 and "background" in s.caption)
    image = scene.draw()
    assert asked_by(scene.caption) == ([(s.colour, s.place) for s in scene.shapes], scene.background)
    assert misses(image, scene.caption) == []
    other_place = next(place for place in PLACES if place not in {s.place for s in scene.shapes})
    first = scene.shapes[0]
    moved = scene.caption.replace(f"{first.kind} {first.place}", f"{first.kind} {other_place}")
    assert misses(image, moved) == [f"{first.colour}: {first.place}"]
    absent = next(c for c in COLOURS if c not in {s.colour for s in scene.shapes})
    assert misses(image, scene.caption.replace(first.colour, absent, 1)) == [f"{absent}: absent"]
    other_background = next(b for b in BACKGROUNDS if b != scene.background)
    assert misses(image, scene.caption.replace(scene.background, other_background)) == [
        f"background: {scene.background}"
    ]


def test_unknown_words_are_what_the_tokenizer_cannot_read():
    tokenizer = build_tokenizer()
    prompts = [
        "A BIG red circle, in the middle!",
        "a grey-ish square at the top-left",
        "3 red circles",
        *EXAMPLE_PROMPTS,
    ]
    for prompt in prompts:
        ids = tokenizer(prompt).input_ids[1:-1]
        words = re.findall("[a-z]+", prompt.lower())
        unread = [word for word, token in zip(words, ids, strict=True) if token == tokenizer.unk_token_id]
        assert unknown_words(prompt) == list(dict.fromkeys(unread)), prompt
    assert unknown_words("a big red circle in the middle, big") == ["big", "middle"]
    assert all(not unknown_words(scene.caption) for scene in make_scenes(200, seed=6))
    assert all(not unknown_words(prompt) for prompt in HELD_OUT_PROMPTS)


def test_unknown_words_warn_naming_them_and_listing_the_vocabulary():
    with pytest.warns(ParadiffWarning) as caught:
        assert warn_unknown_words("a big red circle in the middle") == ["big", "middle"]
    message = str(caught[0].message)
    assert "'big'" in message and "'middle'" in message and "'big' -> 'large'" in message
    for words in KNOWN_WORDS.values():
        assert all(word in message for word in words)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_unknown_words(EXAMPLE_PROMPTS[0]) == []
        assert call_kwargs("sd", EXAMPLE_PROMPTS[1]) == {"prompt": EXAMPLE_PROMPTS[1], "guidance_scale": 2.0}
    with pytest.warns(ParadiffWarning, match="'zebra'"):
        call_kwargs("pixart", "a zebra")
    pixart = call_kwargs("pixart", "a red circle", warn=False)
    assert pixart["use_resolution_binning"] is False
    assert pixart["clean_caption"] is False  # PixArt's cleaning needs bs4 and ftfy, and only warns without them


def test_suggestions_name_known_words_for_unknown_ones():
    for unknown, known in SUGGESTIONS.items():
        assert unknown_words(unknown) == [unknown] and not unknown_words(known), (unknown, known)


def test_only_rank_zero_warns(monkeypatch):
    """Under a process group each rank calls the pipeline: the job warns once, on rank 0."""
    for rank, expected in ((1, 0), (0, 1)):
        fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda r=rank: r)
        monkeypatch.setitem(sys.modules, "torch.distributed", fake)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_unknown_words("a big circle")
        assert len(caught) == expected, rank


def test_missing_weights_say_how_to_rebuild(monkeypatch, tmp_path):
    import paradiff.builtin as builtin

    monkeypatch.setattr(builtin, "WEIGHTS", Path(tmp_path))
    with pytest.raises(Exception, match="python -m paradiff.builtin.train"):
        builtin.pipeline_folder("sd")
