"""``motion_train``: a video model on the picture U-Net (AnimateDiff's motion modules), from the shipped parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AnimateDiffSDXLPipeline, UNet2DConditionModel
from training_runs import as_the_script, weights_in
from transformers import CLIPTextModel

from paradiff.builtin import FRAMES, WEIGHTS
from paradiff.builtin.clips import TEST_PROMPTS, Motion, make_clips
from paradiff.builtin.configs import build_tokenizer
from paradiff.builtin.motion_train import (
    END_WORD,
    Drawer,
    Tuning,
    main,
    pooled_text_encoder,
    pooled_tokenizer,
    sdxl_unet_from,
    train,
    with_motion,
)
from paradiff.builtin.scenes import HELD_OUT_PROMPTS
from paradiff.builtin.train import token_ids

#: The script's short runs: each stage its steps x 0.002 (at least 2), on 8 scenes and 4 clips, at 64 px.
SHORT_RUN = {"scale": 0.002, "seed": 0, "pictures": WEIGHTS, "size": 64}
STATES = ("pictures", "pictures-tune", "clips", "clips-high-noise", "clips-tune")


def shipped_text_encoder() -> CLIPTextModel:
    return CLIPTextModel.from_pretrained(WEIGHTS / "sd" / "text_encoder")


def drawer_from_shipped(size: int = 64) -> Drawer:
    unet = sdxl_unet_from(UNet2DConditionModel.from_pretrained(WEIGHTS / "sd" / "unet"), 64)
    return Drawer(unet, pooled_text_encoder(shipped_text_encoder(), pooled_tokenizer()), size)


@torch.no_grad()
def test_the_second_text_encoder_starts_as_the_shipped_one_and_pools_at_the_captions_end():
    tokenizer, shipped = pooled_tokenizer(), shipped_text_encoder()
    encoder = pooled_text_encoder(shipped, tokenizer)
    end = tokenizer.convert_tokens_to_ids(END_WORD)
    assert end == len(tokenizer) - 1, "the end word has the highest id, where transformers' CLIP pools"
    ids, _ = token_ids(tokenizer, [HELD_OUT_PROMPTS[0]])
    shipped_ids, _ = token_ids(build_tokenizer(), [HELD_OUT_PROMPTS[0]])
    last = shipped_ids[0].tolist().index(shipped.config.eos_token_id)
    assert ids[0, last] == end and torch.equal(ids[0, :last], shipped_ids[0, :last])
    new, old = encoder(ids, output_hidden_states=True), shipped(shipped_ids, output_hidden_states=True)
    torch.testing.assert_close(new.hidden_states[-2], old.hidden_states[-1], rtol=0, atol=1e-6)
    torch.testing.assert_close(new.last_hidden_state, old.last_hidden_state, rtol=0, atol=1e-6)
    pooled = encoder.text_model(ids).pooler_output
    torch.testing.assert_close(pooled[0], new.last_hidden_state[0, last], rtol=0, atol=0)
    clip_ids, _ = token_ids(tokenizer, [TEST_PROMPTS[0]])
    assert tokenizer.unk_token_id not in clip_ids[0].tolist(), "the motion words are known"
    trained = [name for name, weight in encoder.named_parameters() if weight.requires_grad]
    assert trained and all(
        name.startswith(("text_model.encoder.layers.2.", "text_model.final_layer_norm.", "text_projection."))
        for name in trained
    )


def test_the_sdxl_unet_keeps_every_shipped_weight_but_the_added_embedding_and_the_time_projections():
    shipped = UNet2DConditionModel.from_pretrained(WEIGHTS / "sd" / "unet")
    unet, kept = sdxl_unet_from(shipped, 64), shipped.state_dict()
    differ = [
        name
        for name, weight in unet.state_dict().items()
        if name not in kept or kept[name].shape != weight.shape or not torch.equal(kept[name], weight)
    ]
    assert unet.config.addition_embed_type == "text_time" and unet.config.resnet_time_scale_shift == "default"
    assert differ and all(name.startswith("add_embedding.") or ".time_emb_proj." in name for name in differ), differ


@torch.no_grad()
def test_the_motion_modules_start_as_the_identity_on_every_frame():
    drawer = drawer_from_shipped().eval()
    picture = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps, (ids, _) = torch.tensor([999, 500]), token_ids(pooled_tokenizer(), list(TEST_PROMPTS[:2]))
    drawn = drawer(picture, timesteps, ids)
    moving = with_motion(drawer).eval()
    clip = moving(picture[:, :, None].expand(-1, -1, 4, -1, -1).contiguous(), timesteps, ids)
    assert clip.shape == (2, 4, 4, 8, 8)
    torch.testing.assert_close(clip, drawn[:, :, None].expand_as(clip), rtol=0, atol=1e-5)
    assert any("motion_modules" in name for name, _ in moving.unet.named_parameters())


@pytest.fixture(scope="module")
def short_motion_run(tmp_path_factory) -> Path:
    """The script's output folder after a short run (:data:`SHORT_RUN`), its stages' states in ``state/``."""
    out = tmp_path_factory.mktemp("short-motion-run")
    as_the_script(train, out, **SHORT_RUN, checkpoints=out / "state")
    return out


@pytest.mark.timeout(300)
def test_a_short_run_writes_an_animatediff_pipeline_that_loads_offline_and_draws_a_clip(short_motion_run):
    assert sorted(path.stem for path in (short_motion_run / "state").glob("*.pt")) == sorted(STATES)
    pipe = AnimateDiffSDXLPipeline.from_pretrained(short_motion_run / "video")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder is None and not pipe.config.force_zeros_for_empty_prompt
    assert (short_motion_run / "video" / "vae").resolve() == (WEIGHTS / "sd" / "vae").resolve(), "the VAE is linked"
    motion = {name: weight for name, weight in pipe.unet.state_dict().items() if "motion_modules" in name}
    assert motion.keys() == pipe.motion_adapter.state_dict().keys()
    assert all(torch.equal(weight, pipe.motion_adapter.state_dict()[name]) for name, weight in motion.items())
    result = pipe(
        TEST_PROMPTS[0],
        num_frames=FRAMES,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=2.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    frames = np.asarray(result.frames[0])
    assert frames.shape == (FRAMES, 64, 64, 3) and np.isfinite(frames).all()


@pytest.mark.timeout(300)
def test_a_run_that_finds_every_stages_state_writes_the_same_weights(short_motion_run, tmp_path):
    as_the_script(train, tmp_path, **SHORT_RUN, checkpoints=short_motion_run / "state")
    for part in ("unet", "text_encoder_2"):
        first, again = (weights_in(run / "video" / part) for run in (short_motion_run, tmp_path))
        assert first.keys() == again.keys() and all(torch.equal(first[name], again[name]) for name in first), part


@pytest.mark.timeout(300)
def test_tuning_a_written_model_again_runs_the_last_stage_alone_from_its_weights(short_motion_run, tmp_path):
    """``--tune-from DIR --clip-tune 2``: only the clips' tuning runs, from DIR's video model (2 steps move it by
    little, where the whole script's start would differ wholly); the model written is its moving average, with DIR's
    configs and tokenizer and the pictures' VAE linked."""
    out, state = tmp_path / "out", tmp_path / "state"
    flags = ["--scale", "0.002", "--size", "64", "--clip-tune", "2", "--checkpoints", str(state)]
    main(["--out", str(out), "--tune-from", str(short_motion_run), *flags])
    assert sorted(path.name for path in state.iterdir()) == ["clips-retune.pt"], "only the last stage ran"
    tuned = torch.load(state / "clips-retune.pt", weights_only=False)
    assert tuned["step"] == 2
    for part, prefix in (("unet", "unet."), ("text_encoder_2", "text_encoder.")):
        started, written = (weights_in(run / "video" / part) for run in (short_motion_run, out))
        moved = max(float((tuned["drawer"][prefix + name] - started[name].float()).abs().max()) for name in started)
        assert 0 < moved < 1e-3, (part, moved)
        average = {name: tuned["average"][prefix + name].to(written[name].dtype) for name in written}
        assert all(torch.equal(written[name], average[name]) for name in written), part
    for part in ("unet/config.json", "text_encoder_2/config.json", "tokenizer_2/tokenizer.json", "model_index.json"):
        assert (out / "video" / part).read_text() == (short_motion_run / "video" / part).read_text(), part
    assert (out / "video" / "vae").resolve() == (WEIGHTS / "sd" / "vae").resolve()


@pytest.mark.timeout(300)
def test_a_retune_that_holds_colour_is_a_stage_of_its_own_and_its_loss_reads_the_shape_maps(
    short_motion_run, tmp_path, monkeypatch
):
    """``--colour-weight 2 --small-draw 2``: its own state and seed, and the colour term in its loss (each step's
    batch carries shape maps, and the term is added: with the term's weight 0 the same batches train other weights)."""
    import paradiff.builtin.motion_train as motion_train

    terms = []
    counted = motion_train.colour_error
    monkeypatch.setattr(motion_train, "colour_error", lambda *args: terms.append(counted(*args)) or terms[-1])
    flags = ["--scale", "0.002", "--size", "64", "--clip-tune", "2", "--tune-from", str(short_motion_run)]
    runs = {}
    for weight in ("2", "0"):
        out, state = tmp_path / weight, tmp_path / f"state-{weight}"
        main(["--out", str(out), *flags, "--colour-weight", weight, "--small-draw", "2", "--checkpoints", str(state)])
        assert sorted(path.name for path in state.iterdir()) == ["clips-colour-retune.pt"]
        runs[weight] = torch.load(state / "clips-colour-retune.pt", weights_only=False)["drawer"]
    assert len(terms) == 2 and all(term > 0 for term in terms), "the term counted at each of weight 2's steps"
    assert any(not torch.equal(runs["2"][name], runs["0"][name]) for name in runs["2"]), "the term moved the weights"


def test_a_focus_draws_the_clips_showing_all_its_words_more_often_on_top_of_the_small_draw():
    tuning = Tuning(small_draw=2, focus=("square", "gray"), focus_draw=4)
    assert tuning.chance(Motion("square", "red", "small", "gray", "from left to right")) == 8
    assert tuning.chance(Motion("square", "red", "large", "gray", "from left to right")) == 4
    assert tuning.chance(Motion("square", "red", "large", "white", "from left to right")) == 1, "both words asked"
    assert tuning.chance(Motion("circle", "red", "small", "gray", "from left to right")) == 2
    assert Tuning(focus_draw=4).chance(Motion("square", "red", "large", "gray", "from left to right")) == 1


def test_the_tuning_flags_reach_the_retunes_batches(short_motion_run, tmp_path, monkeypatch):
    """``--tune-noise low --focus SIZE,COLOUR --focus-draw 3`` (the first clip's words): the retune draws its batches
    in the low band, the focused clips three times as often (stopped at its batches: no step is trained)."""
    import paradiff.builtin.motion_train as motion_train

    class Drawn(Exception):
        pass

    def batches(latents, clips, tokenizer, generator, band, maps, chances, shapes):
        raise Drawn(band, chances, [clip.motion for clip in clips])

    monkeypatch.setattr(motion_train, "video_batches", batches)
    first = make_clips(4, 0)[0].motion
    flags = ["--scale", "0.002", "--size", "64", "--clip-tune", "2", "--tune-from", str(short_motion_run)]
    focus = ["--focus", f"{first.size},{first.colour}", "--focus-draw", "3"]
    with pytest.raises(Drawn) as drawn:
        main(["--out", str(tmp_path), *flags, "--tune-noise", "low", *focus])
    band, chances, motions = drawn.value.args
    assert band == "low" and motions[0] == first
    assert chances == [3.0 if (m.size, m.colour) == (first.size, first.colour) else 1.0 for m in motions]
    assert len(set(chances)) == 2, "some clips are not focused"


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--size", "100"], "--size 100 is not a multiple of 32"),
        (["--clip-tune", "0"], "--clip-tune 0 is below 1; give a number of steps"),
        (["--tune-from", str(WEIGHTS / "sd")], "holds no video/ AnimateDiffSDXLPipeline; give a folder this script"),
        (["--colour-weight", "-1"], "--colour-weight -1 is below 0; give 0 (no colour term) or more"),
        (["--small-draw", "0"], "--small-draw 0 is not above 0; give 1 (an even draw) or more"),
        (["--focus", "small,round"], "--focus word 'round' is no kind, size, colour or background"),
        (["--focus", "square", "--focus-draw", "0"], "--focus-draw 0 is not above 0; give 1 (an even draw) or more"),
        (["--focus-draw", "4"], "--focus-draw 4 draws nothing more often without --focus; name the words"),
        (["--tune-noise", "mid"], "--tune-noise: invalid choice: 'mid'"),
    ],
)
def test_the_script_refuses_what_it_cannot_run_before_writing_anything(tmp_path, capsys, flags, refusal):
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), *flags])
    assert exited.value.code == 2
    assert refusal in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
