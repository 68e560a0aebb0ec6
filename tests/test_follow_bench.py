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
from paradiff.builtin.follow import CHECKS, judge
from paradiff.builtin.scenes import SEEN_PROMPTS, SHAPES, asked_scene
from paradiff.builtin.train import to_pixels
from paradiff.loading import load_pipeline


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
    """``--weights DIR``: DIR's denoiser, and DIR's VAE and text encoder when it has them (a training run's video
    model, whose motion words' rows are its own)."""
    pipe = load_pipeline("paradiff-tiny-video")
    shipped = pipe.vae.config.scaling_factor
    shipped_rows = pipe.text_encoder_2.get_input_embeddings().weight.clone()
    (tmp_path / "unet").symlink_to(WEIGHTS / "video" / "unet")
    follow_bench.with_weights(pipe, tmp_path)
    assert pipe.vae.config.scaling_factor == shipped, "no VAE in the folder: the model's own is kept"
    pipe.vae.register_to_config(scaling_factor=0.5)
    pipe.vae.save_pretrained(tmp_path / "vae")
    with torch.no_grad():
        pipe.text_encoder_2.get_input_embeddings().weight[-1] = 7.0
    pipe.text_encoder_2.save_pretrained(tmp_path / "text_encoder_2")
    pipe = load_pipeline("paradiff-tiny-video")
    follow_bench.with_weights(pipe, tmp_path)
    assert pipe.vae.config.scaling_factor == 0.5
    rows = pipe.text_encoder_2.get_input_embeddings().weight
    assert torch.equal(rows[:-1], shipped_rows[:-1]) and bool((rows[-1] == 7.0).all())


def test_seen_prompts_with_the_video_model_are_refused_before_any_pipeline_loads(follow_bench, monkeypatch, tmp_path):
    monkeypatch.setattr(follow_bench, "load_pipeline", lambda model: pytest.fail(f"loaded {model}"))
    out = tmp_path / "follow.json"
    with pytest.raises(SystemExit) as refused:
        follow_bench.main(["--models", "paradiff-tiny,paradiff-tiny-video", "--seen", "--out", str(out)])
    assert refused.value.code == 2 and not out.exists()


@pytest.mark.timeout(120)
def test_from_step_starts_from_the_asked_drawing_noised_by_the_seed_at_that_step(follow_bench):
    """The started latents, less the seed's noise at the K-th timestep, are the renderer's drawing of what the prompt
    asks for (every check right), encoded; the remaining timesteps are the schedule's from K on."""
    pipe = load_pipeline("paradiff-tiny-dit")
    prompt = SEEN_PROMPTS[0]
    started = follow_bench.started_from_asked(pipe, [(prompt, 3)], 8, DEFAULT_SIZE["pixart"], 5)
    pipe.scheduler.set_timesteps(8)
    assert started["timesteps"] == pipe.scheduler.timesteps.tolist()[5:]
    kept = pipe.scheduler.alphas_cumprod[started["timesteps"][0]]
    noise = torch.randn(started["latents"].shape, generator=torch.Generator().manual_seed(3))
    clean = (started["latents"] - (1 - kept).sqrt() * noise) / kept.sqrt() / pipe.vae.config.scaling_factor
    asked = asked_scene(prompt).draw(256)[None]
    with torch.no_grad():
        encoded = pipe.vae.encode(to_pixels(asked.copy())).latent_dist.mean
        pixels = ((pipe.vae.decode(clean).sample.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()
    torch.testing.assert_close(clean, encoded, atol=1e-4, rtol=0)
    judged = judge(pixels[0], prompt)
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
        (["--models", "paradiff-tiny", "--from-step", "2"], "paradiff-tiny's DDIM does not"),
        (["--models", "paradiff-tiny-video", "--from-step", "2"], "paradiff-tiny-video's DDIM does not"),
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
def test_a_quick_video_run_writes_its_rates_and_the_frames_read_per_asked_kind(follow_bench, tmp_path, capsys):
    """The documented video command's path end to end, on 2 clips (a circle and a square) of 4 steps."""
    out = tmp_path / "follow.json"
    quick = ["--prompts", "2", "--seeds", "1", "--steps", "4"]
    follow_bench.main(["--models", "paradiff-tiny-video", *quick, "--out", str(out)])
    run = json.loads(out.read_text())
    result = run["results"][0]
    shares = result["frames_by_kind"]
    assert run["steps"] == 4 and result["drawn"] == 2 and result["size"] == DEFAULT_SIZE["video"]
    assert set(shares) == {"circle", "square"} == {next(w for w in p.split() if w in SHAPES) for p in TEST_PROMPTS[:2]}
    printed = capsys.readouterr().out
    assert "frames read as the asked kind: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()) in printed
    row = " | ".join(f"{100 * result['rates'][check]:.0f}%" for check in (*result["checks"], "all"))
    assert f"| paradiff-tiny-video | 128 px | 2 | 2 | {row} |" in printed
