"""``benchmarks/follow_bench.py``, the command the docs' follow rates come from: it draws the asked prompts, and the
rates it prints and writes are the follow measure's reading of those pictures; ``--seen`` with the video model is
refused before anything is loaded."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_script

from paradiff.builtin import DEFAULT_SIZE, WEIGHTS
from paradiff.builtin.clips import TEST_MOTIONS, TEST_PROMPTS, middle_clip
from paradiff.builtin.follow import CHECKS, judge, judge_clip
from paradiff.builtin.scenes import SEEN_PROMPTS, SHAPES, asked_scene
from paradiff.builtin.train import to_pixels
from paradiff.loading import TRAINED_MODELS, load_pipeline


@pytest.fixture(scope="module")
def follow_bench():
    return load_script("follow_bench")


@pytest.mark.timeout(120)
def test_a_quick_run_on_the_seen_prompts_writes_the_rates_of_the_pictures_it_drew(follow_bench, tmp_path, capsys):
    """``--quick --seen``: 4 seen prompts, seed 0, 4 steps. Each rate is the share of pictures not missing that check,
    and the printed row is the written one."""
    out = tmp_path / "follow.json"
    follow_bench.main(["--models", "paradiff-tiny", "--quick", "--seen", "--out", str(out)])
    result = json.loads(out.read_text())["results"][0]
    assert result["prompts"] == list(SEEN_PROMPTS[:4]) and result["drawn"] == 4
    missed = list(result["misses"].values())
    expected = {check: 1 - sum(check in checks for checks in missed) / 4 for check in CHECKS}
    assert result["rates"] == pytest.approx(expected | {"all": 1 - len(missed) / 4})
    shares = " | ".join(f"{100 * result['rates'][check]:.0f}%" for check in (*CHECKS, "all"))
    assert f"| paradiff-tiny | 128 px | 2 | 4 | {shares} |" in capsys.readouterr().out


def test_other_weights_bring_their_vae_and_text_encoder_where_their_folder_holds_them(follow_bench, tmp_path):
    """``--weights DIR``: DIR's denoiser, and DIR's VAE and text encoder when it has them (a video model tuned with
    ``--vae-tune``, or trained with ``--motion-only``, whose motion words' rows are its own)."""
    pipe = load_pipeline("paradiff-tiny-video")
    shipped = pipe.vae.config.scaling_factor
    shipped_rows = pipe.text_encoder.get_input_embeddings().weight.clone()
    (tmp_path / "transformer").symlink_to(WEIGHTS / "video" / "transformer")
    follow_bench.with_weights(pipe, "video", tmp_path)
    assert pipe.vae.config.scaling_factor == shipped, "no VAE in the folder: the model's own is kept"
    pipe.vae.register_to_config(scaling_factor=0.5)
    pipe.vae.save_pretrained(tmp_path / "vae")
    with torch.no_grad():
        pipe.text_encoder.get_input_embeddings().weight[-1] = 7.0
    pipe.text_encoder.save_pretrained(tmp_path / "text_encoder")
    pipe = load_pipeline("paradiff-tiny-video")
    follow_bench.with_weights(pipe, "video", tmp_path)
    assert pipe.vae.config.scaling_factor == 0.5
    rows = pipe.text_encoder.get_input_embeddings().weight
    assert torch.equal(rows[:-1], shipped_rows[:-1]) and bool((rows[-1] == 7.0).all())


def test_seen_prompts_with_the_video_model_are_refused_before_any_pipeline_loads(follow_bench, monkeypatch, tmp_path):
    monkeypatch.setattr(follow_bench, "load_pipeline", lambda model: pytest.fail(f"loaded {model}"))
    out = tmp_path / "follow.json"
    with pytest.raises(SystemExit) as refused:
        follow_bench.main(["--models", "paradiff-tiny,paradiff-tiny-video", "--seen", "--out", str(out)])
    assert refused.value.code == 2 and not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["paradiff-tiny-dit", "paradiff-tiny-video"])
def test_from_step_starts_from_the_asked_drawing_noised_by_the_seed_at_that_step(follow_bench, model):
    """The started latents, less the seed's noise at the K-th timestep, are the renderer's drawing of what the prompt
    asks for (every check right), encoded; the remaining timesteps are the schedule's from K on."""
    kind = TRAINED_MODELS[model]
    pipe = load_pipeline(model)
    prompt = TEST_PROMPTS[2] if kind == "video" else SEEN_PROMPTS[0]
    started = follow_bench.started_from_asked(pipe, kind, [(prompt, 3)], 8, DEFAULT_SIZE[kind], 5)
    pipe.scheduler.set_timesteps(8)
    assert started["timesteps"] == pipe.scheduler.timesteps.tolist()[5:]
    kept = pipe.scheduler.alphas_cumprod[started["timesteps"][0]]
    noise = torch.randn(started["latents"].shape, generator=torch.Generator().manual_seed(3))
    clean = (started["latents"] - (1 - kept).sqrt() * noise) / kept.sqrt() / pipe.vae.config.scaling_factor
    frames = clean[0].transpose(0, 1) if kind == "video" else clean
    asked = middle_clip(TEST_MOTIONS[2]).draw(256) if kind == "video" else asked_scene(prompt).draw(256)[None]
    with torch.no_grad():
        encoded = pipe.vae.encode(to_pixels(asked.copy())).latent_dist.mean
        pixels = ((pipe.vae.decode(frames).sample.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()
    torch.testing.assert_close(frames, encoded, atol=1e-4, rtol=0)
    judged = judge_clip(pixels, prompt) if kind == "video" else judge(pixels[0], prompt)
    assert all(judged.values()), judged


def test_frames_read_as_the_asked_kind_are_counted_per_asked_kind(follow_bench):
    """The renderer's clips read as their kind in every frame; a triangle prompt answered with a circle's frames in
    none."""
    motions = [next(m for m in TEST_MOTIONS if m.kind == kind) for kind in SHAPES]
    clips = [middle_clip(m).draw(128) for m in motions]
    calls = [(m.caption(), 0) for m in motions]
    assert follow_bench.asked_kind_shares(clips, calls) == {"circle": 1.0, "square": 1.0, "triangle": 1.0}
    assert follow_bench.asked_kind_shares(clips[:1], calls[2:]) == {"triangle": 0.0}


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--from-step", "0"], "use 1 to 19"),
        (["--from-step", "4", "--steps", "4"], "use 1 to 3"),
        (["--models", "paradiff-tiny", "--from-step", "2"], "DDIM"),
    ],
)
def test_a_from_step_the_run_cannot_take_is_refused_before_any_pipeline_loads(
    follow_bench, monkeypatch, tmp_path, capsys, argv, refusal
):
    monkeypatch.setattr(follow_bench, "load_pipeline", lambda model: pytest.fail(f"loaded {model}"))
    out = tmp_path / "follow.json"
    with pytest.raises(SystemExit) as refused:
        follow_bench.main(["--models", "paradiff-tiny-dit", *argv, "--out", str(out)])
    assert refused.value.code == 2 and refusal in capsys.readouterr().err and not out.exists()


@pytest.mark.timeout(120)
def test_a_quick_video_run_from_a_step_writes_it_and_the_frames_read_per_asked_kind(follow_bench, tmp_path, capsys):
    """The documented ``--from-step`` command's path end to end, on 2 clips (a circle and a square) of 4 steps."""
    out = tmp_path / "follow.json"
    quick = ["--prompts", "2", "--seeds", "1", "--steps", "4"]
    follow_bench.main(["--models", "paradiff-tiny-video", *quick, "--from-step", "2", "--out", str(out)])
    run = json.loads(out.read_text())
    shares = run["results"][0]["frames_by_kind"]
    assert run["from_step"] == 2 and run["steps"] == 4 and run["results"][0]["drawn"] == 2
    assert set(shares) == {"circle", "square"} == {next(w for w in p.split() if w in SHAPES) for p in TEST_PROMPTS[:2]}
    assert "frames read as the asked kind: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()) in (
        capsys.readouterr().out
    )
