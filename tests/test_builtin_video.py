"""``paradiff-tiny-video``: its clips, its shipped weights and that it follows prompts, and the Latte route's training
script (``video_train``; the shipped model's own script is tested in test_motion_train.py)."""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AnimateDiffSDXLPipeline, AutoencoderKL, LattePipeline, PixArtTransformer2DModel
from scene_analysis import motion_misses
from training_runs import as_the_script, weights_in
from transformers import CLIPTextModel

from paradiff.builtin import DEFAULT_SIZE, FRAMES, VIDEO_EXAMPLE_PROMPTS, WEIGHTS, call_kwargs, pipeline_folder
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
from paradiff.builtin.scenes import COLOURS, SHAPES, SIZES
from paradiff.builtin.train import KIND_WEIGHT, lr_at, token_ids, train_text_encoder
from paradiff.builtin.video_train import (
    DATASET_CLIPS,
    HIGH_NOISE_FROM,
    HIGH_NOISE_SHARE,
    KIND_TUNE_LR,
    KIND_TUNE_STEPS,
    VIDEO_BATCH,
    direction_classes,
    extend_text_encoder,
    kind_maps,
    main,
    parse_kind_draw,
    train,
    video_batches,
    video_dit_from,
)
from paradiff.builtin.vocabulary import unknown_words, warn_unknown_words
from paradiff.errors import ParadiffWarning
from paradiff.loading import load_pipeline

#: The training script's short runs: each stage its steps x 0.001 (at least 2) on 4 clips, at 64 px (a quarter of the
#: shipped size: the script's logic is the same, and a sixteenth of the tokens).
SHORT_RUN = {"scale": 0.001, "seed": 0, "pictures": WEIGHTS, "size": 64}
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


def test_directions_are_classes_of_the_text_encoder_and_pictures_have_none():
    classes = direction_classes(["a red circle moving from right to left", "a red circle at the top"])
    assert classes == {"a red circle moving from right to left": 2, "a red circle at the top": 0}


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


def weights_of(run: Path, part: str) -> dict[str, torch.Tensor]:
    """The weights a training run wrote for ``video/<part>``."""
    return weights_in(run / "video" / part)


@pytest.fixture(scope="module")
def short_video_run(tmp_path_factory) -> Path:
    """The training script's output folder after a short run (:data:`SHORT_RUN`), its stages' saved states in
    ``state/``."""
    out = tmp_path_factory.mktemp("short-video-run")
    as_the_script(train, out, **SHORT_RUN, checkpoints=out / "state")
    return out


@pytest.mark.timeout(300)
def test_video_training_writes_a_pipeline_that_loads_and_draws(short_video_run, tmp_path):
    pipe = LattePipeline.from_pretrained(short_video_run / "video")
    pipe.set_progress_bar_config(disable=True)
    read = [pipe.tokenizer(f"moving {phrase}").input_ids[1:-1] for phrase in DIRECTIONS]
    assert all(len(ids) == 2 and pipe.tokenizer.unk_token_id not in ids for ids in read), "one token per direction"
    assert len({ids[1] for ids in read}) == len(DIRECTIONS)
    assert (short_video_run / "video" / "vae").resolve() == (WEIGHTS / "sd" / "vae").resolve(), "the VAE is linked"
    frames = draw(pipe, TEST_PROMPTS[0], seed=0, steps=2, size=64, clean_caption=False)
    assert frames.shape == (FRAMES, 64, 64, 3) and np.isfinite(frames).all()
    # --resume: stage 4 alone, from a written pipeline; the tokenizer and text encoder are kept as they are
    as_the_script(train, tmp_path / "again", **SHORT_RUN, resume=short_video_run / "video")
    again = LattePipeline.from_pretrained(tmp_path / "again" / "video")
    kept = zip(again.text_encoder.state_dict().values(), pipe.text_encoder.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in kept)
    trained = zip(again.transformer.state_dict().values(), pipe.transformer.state_dict().values(), strict=True)
    assert not all(torch.equal(a, b) for a, b in trained), "stage 4 trained the DiT further"


@pytest.mark.timeout(300)
def test_a_stopped_video_run_resumes_to_the_weights_of_an_unbroken_run(short_video_run, tmp_path, monkeypatch):
    """``--checkpoints``: stopped at stage 4's 2nd step, a run saved stage 3's last state and stage 4's first; run
    again, it goes on from them and writes the video DiT the unbroken short run wrote."""
    import paradiff.builtin.train as training
    import paradiff.builtin.video_train as video_training

    monkeypatch.setattr(training, "CHECKPOINT_EVERY", 1)
    unbroken = video_training.video_batches

    def stopping(*args, **kwargs):
        for index, batch in enumerate(unbroken(*args, **kwargs)):
            if index == 1 and kwargs.get("high_noise"):
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(video_training, "video_batches", stopping)
    state = tmp_path / "state"
    with pytest.raises(KeyboardInterrupt):
        as_the_script(train, tmp_path / "out", **SHORT_RUN, checkpoints=state)
    stages = ("video-dit", "video-dit-high-noise")
    assert [torch.load(state / f"{name}.pt", weights_only=False)["step"] for name in stages] == [2, 1]
    monkeypatch.setattr(video_training, "video_batches", unbroken)
    as_the_script(train, tmp_path / "out", **SHORT_RUN, checkpoints=state)
    runs = (short_video_run, tmp_path / "out")
    first, second = (weights_of(run, "transformer") for run in runs)
    assert all(torch.equal(first[name], second[name]) for name in first), "the resumed video DiT differs"


@pytest.mark.timeout(300)
def test_tuning_a_written_video_model_again_runs_stage_5_alone_from_its_dit(short_video_run, tmp_path):
    """``--tune-from DIR --kind-tune 2 --shape-weight 5``: only stage 5 runs, from DIR's video DiT (2 steps move
    it by little, where stage 3's start would differ wholly), at stage 5's peak learning rate; the DiT written is
    its moving average with DIR's config, beside DIR's tokenizer and text encoder."""
    out, state = tmp_path / "out", tmp_path / "state"
    flags = ["--scale", "0.001", "--size", "64", "--kind-tune", "2", "--shape-weight", "5"]
    main(["--out", str(out), "--tune-from", str(short_video_run), *flags, "--checkpoints", str(state)])
    assert sorted(path.name for path in state.iterdir()) == ["video-dit-retune.pt"], "only stage 5 ran"
    tuned = torch.load(state / "video-dit-retune.pt", weights_only=False)
    assert tuned["step"] == 2 and tuned["optimizer"]["param_groups"][0]["lr"] == lr_at(1, 2, KIND_TUNE_LR)
    started = weights_of(short_video_run, "transformer")
    moved = max(float((tuned["video_dit"][name] - started[name].float()).abs().max()) for name in started)
    assert 0 < moved < 1e-3, moved
    written = weights_of(out, "transformer")
    assert all(torch.equal(written[name], tuned["average"][name].half()) for name in written)
    for part in ("transformer/config.json", "text_encoder/config.json", "tokenizer/tokenizer_config.json"):
        assert (out / "video" / part).read_text() == (short_video_run / "video" / part).read_text(), part
    kept, encoder = (weights_of(run, "text_encoder") for run in (out, short_video_run))
    assert all(torch.equal(kept[name], tensor) for name, tensor in encoder.items())


@pytest.mark.timeout(300)
def test_a_tuning_with_vae_tune_encodes_with_the_tuned_vae_and_ships_it_and_a_later_tuning_keeps_it(
    short_video_run, tmp_path, monkeypatch
):
    """``--vae-tune 2 --vae-contrast 0.1``: the VAE is tuned (``train.retune_vae``) before the clips are encoded with
    it, and ``video/vae`` holds it instead of the link to the pictures'; tuned again without the option, the model
    keeps the VAE it has."""
    import paradiff.builtin.train as training
    import paradiff.builtin.video_train as video_training

    monkeypatch.setattr(training, "VAE_BATCH", 4)  # the tuning and the scale as shipped, on less data
    monkeypatch.setattr(training, "VAE_SCALE_SCENES", 8)
    encoded_with = []

    def encode_clips(vae, *args):
        encoded_with.append(vae.config.scaling_factor)
        return unrecorded(vae, *args)

    unrecorded = video_training.encode_clips
    monkeypatch.setattr(video_training, "encode_clips", encode_clips)
    flags = ["--scale", "0.001", "--size", "64", "--kind-tune", "2"]
    first, second = tmp_path / "first", tmp_path / "second"
    main(["--out", str(first), "--tune-from", str(short_video_run), *flags, "--vae-tune", "2", "--vae-contrast", "0.1"])
    vae = first / "video" / "vae"
    assert vae.is_dir() and not vae.is_symlink(), "the tuned VAE ships with the video model"
    scale = LattePipeline.from_pretrained(first / "video").vae.config.scaling_factor
    assert encoded_with == [scale] and scale != AutoencoderKL.load_config(WEIGHTS / "sd" / "vae")["scaling_factor"]
    pictures, tuned = weights_in(WEIGHTS / "sd" / "vae"), weights_in(vae)
    assert not all(torch.equal(tuned[name], pictures[name]) for name in pictures), "the VAE was tuned"
    main(["--out", str(second), "--tune-from", str(first), *flags])
    kept = second / "video" / "vae"
    assert not kept.is_symlink() and encoded_with == [scale, scale]
    assert all(torch.equal(tensor, tuned[name]) for name, tensor in weights_in(kept).items()), "the VAE is kept"


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--kind-tune", "0"], "give it --kind-tune N steps"),
        (["--high-noise-steps", "3"], "so --high-noise-steps has nothing to do"),
        (["--resume", "somewhere"], "so --resume has nothing to do"),
    ],
)
def test_tuning_a_video_model_again_refuses_what_it_cannot_run(short_video_run, tmp_path, capsys, flags, refusal):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--tune-from", str(short_video_run), *flags])
    assert refusal in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--tune-from", str(short_video_run / "video"), "--kind-tune", "2"])
    assert "holds no video/ LattePipeline; give a folder this script wrote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--tune-from", str(WEIGHTS), "--kind-tune", "2"])
    assert "holds no video/ LattePipeline" in capsys.readouterr().err, "the shipped video model is not a Latte one"
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_the_text_encoder_trained_from_a_row_on_keeps_every_other_weight_as_it_was():
    """``train_text_encoder(..., new_rows_from=N)``: the embedding rows from N on train; every other weight, the
    rows before N too, ends bit for bit as it started (no gradient, and no weight decay, reaches them)."""
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    encoder = CLIPTextModel.from_pretrained(WEIGHTS / "sd" / "text_encoder")
    known = len(encoder.get_input_embeddings().weight)
    encoder = extend_text_encoder(encoder, tokenizer)
    before = {name: tensor.clone() for name, tensor in encoder.state_dict().items()}
    captions = [clip.caption for clip in make_clips(8, seed=0)]
    train_text_encoder(encoder, tokenizer, captions, 20, 0, direction_classes(captions), new_rows_from=known)
    after = encoder.state_dict()
    table = next(name for name in after if name.endswith("token_embedding.weight"))
    assert torch.equal(after[table][:known], before[table][:known])
    assert all(not torch.equal(a, b) for a, b in zip(after[table][known:], before[table][known:], strict=True))
    assert all(torch.equal(after[name], before[name]) for name in after if name != table)
    assert not any(p.requires_grad for p in encoder.parameters()), "frozen after"


@pytest.mark.timeout(300)
def test_a_motion_only_run_trains_the_motion_words_and_temporal_blocks_and_keeps_the_pictures_weights(tmp_path):
    """``--motion-only``: stage 1 trains only the text encoder's rows for the motion words, and stages 3 to 5 only the
    temporal blocks (stage 5's moving average too), so a caption of the pictures' words reaches the spatial blocks
    as the pictures' DiT learned it; every other weight is the pictures' as stage 3 starts from them."""
    main(["--out", str(tmp_path), "--scale", "0.001", "--size", "64", "--motion-only"])
    encoder, pictures_encoder = weights_of(tmp_path, "text_encoder"), weights_in(WEIGHTS / "sd" / "text_encoder")
    table = next(name for name in encoder if name.endswith("token_embedding.weight"))
    known = len(pictures_encoder[table])
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    assert len(encoder[table]) == len(tokenizer) > known
    assert torch.equal(encoder[table][:known], pictures_encoder[table])
    untrained = extend_text_encoder(CLIPTextModel.from_pretrained(WEIGHTS / "sd" / "text_encoder"), tokenizer)
    new_rows = zip(encoder[table][known:], untrained.get_input_embeddings().weight.detach().half()[known:], strict=True)
    assert not any(torch.equal(trained, start) for trained, start in new_rows), "every motion word's row trained"
    assert all(torch.equal(encoder[name], tensor) for name, tensor in pictures_encoder.items() if name != table)
    started = video_dit_from(PixArtTransformer2DModel.from_pretrained(WEIGHTS / "pixart" / "transformer"))
    started = {name: tensor.half() for name, tensor in started.state_dict().items()}
    written = weights_of(tmp_path, "transformer")
    temporal = [name for name in written if name.startswith("temporal_transformer_blocks.")]
    assert temporal and all(torch.equal(written[name], started[name]) for name in written if name not in temporal)
    assert not all(torch.equal(written[name], started[name]) for name in temporal), "the temporal blocks trained"


def test_the_training_script_refuses_a_size_the_patches_do_not_divide(capsys):
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--size", "200"])
    assert "--size 200 is not a multiple of 16" in capsys.readouterr().err


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


def test_stage_5_weighs_the_loss_up_on_the_kind_regions_reversed_with_the_clip():
    clips = make_clips(2, seed=0)
    latents = torch.zeros(len(clips), 4, FRAMES, 16, 16)
    maps = kind_maps(clips, 128, 16)
    assert maps.shape == (2, 1, FRAMES, 16, 16) and 0 < maps.mean() < 0.2
    shapes = torch.stack([torch.from_numpy(clip.shape_regions(128)).float() for clip in clips])[:, None]
    shape_share = (kind_maps(clips, 128, 16, shape_share=0.5) - maps) / 0.5
    torch.testing.assert_close(shape_share, torch.nn.functional.adaptive_avg_pool3d(shapes, (FRAMES, 16, 16)))
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    batches = video_batches(latents, clips, tokenizer, torch.Generator().manual_seed(0), True, maps)
    expected = {}
    for clip, kind_map in zip(clips, maps, strict=True):
        for caption, frames in ((clip.caption, kind_map), (clip.reversed().caption, kind_map.flip(1))):
            expected[tuple(token_ids(tokenizer, [caption])[0][0].tolist())] = 1 + KIND_WEIGHT * frames
    seen = 0
    for _ in range(8):
        _, _, _, ids, _, weights = next(batches)
        for row, weight in zip(ids.tolist(), weights, strict=True):
            if tuple(row) in expected:  # else its caption was dropped
                assert torch.equal(weight, expected[tuple(row)])
                seen += 1
    assert seen >= 16
    assert next(video_batches(latents, clips, tokenizer, torch.Generator()))[-1] is None, "an even loss"


def test_stage_5_tunes_the_video_dit_and_writes_its_moving_average(short_video_run):
    """Stage 5 goes on from stage 4's DiT (on the kind-weighted loss); the DiT written is its moving average."""
    state = short_video_run / "state"
    stages = ("video-dit-high-noise", "video-dit-kind-tune")
    stage_4, tuned = (torch.load(state / f"{name}.pt", weights_only=False) for name in stages)
    assert stage_4["step"] == 2 and tuned["step"] == max(2, round(KIND_TUNE_STEPS * SHORT_RUN["scale"]))
    written = weights_of(short_video_run, "transformer")
    assert all(torch.equal(written[name], tuned["average"][name].half()) for name in written)
    assert not all(torch.equal(written[name], tuned["video_dit"][name].half()) for name in written), "the average"
    assert not all(torch.equal(written[name], stage_4["video_dit"][name].half()) for name in written), "stage 5 ran"


def test_stage_5_draws_each_shapes_clips_in_proportion_to_its_kind_draw_weight():
    clips = make_clips(12, seed=0)
    latents = torch.zeros(len(clips), 4, FRAMES, 4, 4)
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    kinds = {
        tuple(token_ids(tokenizer, [caption])[0][0].tolist()): clip.motion.kind
        for clip in clips
        for caption in (clip.caption, clip.reversed().caption)
    }

    def triangle_share(kind_draw: dict | None) -> float:
        batches = video_batches(latents, clips, tokenizer, torch.Generator().manual_seed(2), kind_draw=kind_draw)
        drawn = [kinds[tuple(row)] for _ in range(40) for row in next(batches)[3].tolist() if tuple(row) in kinds]
        return drawn.count("triangle") / len(drawn)

    triangles = sum(clip.motion.kind == "triangle" for clip in clips) / len(clips)
    weighted = parse_kind_draw("triangle=20")
    expected = 20 * triangles / (20 * triangles + 1 - triangles)
    assert 0.1 < triangles < 0.6 and expected > 0.85
    assert abs(triangle_share(None) - triangles) < 0.15 and triangle_share(weighted) > expected - 0.1


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--kind-draw", "hexagon=2"], "argument --kind-draw: 'hexagon' is no shape; use circle, square, triangle"),
        (["--kind-draw", "triangle=0"], "argument --kind-draw: triangle's weight 0 is not above 0"),
        (["--kind-draw", "triangle=a lot"], "argument --kind-draw: triangle's weight 'a lot' is no number"),
        (["--kind-draw", "triangle=3", "--kind-tune", "0"], "--kind-draw weighs stage 5's draw, which --kind-tune 0"),
        (["--shape-weight", "-1"], "argument --shape-weight: -1 is below 0; give 0 (no extra weight)"),
        (["--vae-contrast", "0.1"], "--vae-contrast weighs --vae-tune's loss; give --vae-tune N steps"),
        (["--vae-tune", "-3"], "--vae-tune -3 is below 0; give a number of steps, e.g. 300"),
    ],
)
def test_the_training_script_refuses_a_stage_5_setting_it_cannot_use(tmp_path, capsys, flags, refusal):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), *flags])
    assert refusal in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_stage_4_draws_half_of_each_batch_at_high_noise():
    tokenizer = build_tokenizer(tuple(MOTION_WORDS), DIRECTION_TOKENS)
    clips = make_clips(4, seed=0)
    latents = torch.zeros(len(clips), 4, FRAMES, 4, 4)

    def first_half(high_noise: bool) -> torch.Tensor:
        batches = video_batches(latents, clips, tokenizer, torch.Generator().manual_seed(1), high_noise)
        return torch.stack([next(batches)[2][: int(HIGH_NOISE_SHARE * VIDEO_BATCH)] for _ in range(30)])

    assert (first_half(True) >= HIGH_NOISE_FROM).all()
    assert (first_half(False) < HIGH_NOISE_FROM).any()


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
    """Each checked held-out prompt at the default size, seed 0, 8 steps (for the suite's time: these clips read as
    well as at 20): the asked colour is found and its centroid moves the asked way by at least
    15% of the frame between the first and last quarter of the frames, in at least 75% of them. The follow
    measure's rates on the same clips are reported and held a little under the shipped model's
    (docs/builtin-models.md gives them)."""
    clips = {prompt: draw(video_pipe, prompt, seed=0, steps=8) for prompt in CHECKED_PROMPTS}
    misses = {prompt: motion_misses(frames, prompt) for prompt, frames in clips.items()}
    followed = [prompt for prompt, missed in misses.items() if not missed]
    measured = rates([judge_clip(frames, prompt) for prompt, frames in clips.items()])
    report(
        f"paradiff-tiny-video, {len(clips)} held-out clips: colour moves the asked way {len(followed)}; follow "
        "measure: " + ", ".join(f"{check} {100 * share:.0f}%" for check, share in measured.items())
    )
    assert len(followed) >= 0.75 * len(CHECKED_PROMPTS), {prompt: missed for prompt, missed in misses.items() if missed}
    floors = {"shape": 0.45, "colour": 0.6, "direction": 0.8, "background": 0.9}
    assert all(measured[check] >= floor for check, floor in floors.items()), measured


def test_readme_video_examples_are_the_checked_ones():
    text = "\n".join(path.read_text() for path in DOCS)
    quoted = dict.fromkeys(re.findall(r'"([a-z][a-z ]+ moving [a-z ]+)"', text))
    assert quoted, "neither README.md nor docs/builtin-models.md shows a video prompt"
    assert set(quoted) <= set(VIDEO_EXAMPLE_PROMPTS), set(quoted) - set(VIDEO_EXAMPLE_PROMPTS)
