"""`paradiff bench` on video pipelines: per-frame PSNR and SSIM, flicker, frame strips, animated previews.

The SSIM and flicker figures are checked by hand on tiny arrays, the report on made-up videos whose
differences are known (one bad frame, added flicker), and the whole bench on a tiny CogVideoX on 2 ranks.
"""

from __future__ import annotations

import json
import math

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image
from torchmetrics.functional.image import structural_similarity_index_measure

from paradiff.bench import report
from paradiff.bench.fidelity import video_fidelity
from paradiff.bench.figures import GAP, STRIP_TILE, frame_indices, frame_strip, preview_frames
from paradiff.bench.job import ONE_DEVICE, BenchJob, RunSpec
from paradiff.bench.prompts import VIDEO_SCENES, bench_prompts
from paradiff.bench.report import VIDEO_TABLE_HEADERS, write_report
from paradiff.bench.run import BenchResults, RunResult, bench_on_rank
from paradiff.metrics import SSIM_K1, SSIM_K2, frame_changes, ssim, ssim_window
from paradiff.tiny import save

FRAMES, SIZE = 6, 16


def moving_square(frames: int = FRAMES, size: int = SIZE, seed: int = 0) -> np.ndarray:
    """(F, H, W, 3) in [0, 1]: a bright square one pixel further right in every frame, on a still noisy background."""
    video = np.repeat(np.random.default_rng(seed).uniform(0.1, 0.3, (1, size, size, 3)), frames, axis=0)
    for frame in range(frames):
        video[frame, 4:10, 2 + frame : 8 + frame] = 0.9
    return video


# --- SSIM and flicker by hand ---------------------------------------------------------------------


def test_ssim_window_is_the_usual_gaussian():
    window = ssim_window()
    assert len(window) == 11 and window.sum() == pytest.approx(1.0)
    # 1 / (1 + 2 (e^-1/4.5 + e^-4/4.5 + e^-9/4.5 + e^-16/4.5 + e^-25/4.5)): the centre weight of σ = 1.5
    assert window[5] == pytest.approx(0.26601, abs=1e-5) and window[0] == pytest.approx(window[10])


def test_ssim_of_identical_noisy_and_swapped_images():
    rng = np.random.default_rng(0)
    image = rng.random((24, 20, 3))
    slightly, badly = (np.clip(image + noise * rng.standard_normal(image.shape), 0, 1) for noise in (0.02, 0.2))
    assert ssim(image, image) == pytest.approx(1.0, abs=1e-12)
    assert 0 < ssim(badly, image) < ssim(slightly, image) < 1
    assert ssim(badly, image) == pytest.approx(ssim(image, badly), abs=1e-12)


def test_ssim_of_flat_images_is_the_luminance_term_alone():
    # no variance, no covariance: SSIM = (2ab + C1) / (a² + b² + C1), whatever the window
    a, b, c1 = 0.2, 0.6, SSIM_K1**2
    assert ssim(np.full((8, 8), a), np.full((8, 8), b)) == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1))


def test_ssim_of_a_checkerboard_against_flat_grey_by_hand():
    # The border mirror (without repeating the edge) keeps a checkerboard a checkerboard, so every window
    # sees the same pattern, centred on a light or a dark square: local mean 0.5 ± 0.25 s, with
    # s = (Σ w_k (-1)^k)², and local mean of squares 0.3125 ± 0.25 s (0.75² and 0.25² average to 0.3125).
    parity = np.indices((8, 8)).sum(axis=0) % 2
    board = np.where(parity == 0, 0.75, 0.25)
    grey = np.full((8, 8), 0.5)
    window = ssim_window()
    s = float(np.sum(window * (-1.0) ** np.arange(-5, 6))) ** 2
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    expected = []
    for sign in (1, -1):
        mean = 0.5 + sign * 0.25 * s
        variance = 0.3125 + sign * 0.25 * s - mean**2
        # the grey image: mean 0.5, no variance, so no covariance either
        expected.append((2 * 0.5 * mean + c1) / (0.25 + mean**2 + c1) * c2 / (variance + c2))
    assert ssim(grey, board) == pytest.approx(np.mean(expected), rel=1e-12)


def test_ssim_matches_torchmetrics_that_the_image_reports_use():
    rng = np.random.default_rng(1)
    image = rng.random((19, 23, 3))
    other = np.clip(image + 0.1 * rng.standard_normal(image.shape), 0, 1)
    batch = [torch.from_numpy(array).permute(2, 0, 1)[None] for array in (image, other)]
    expected = float(structural_similarity_index_measure(batch[1], batch[0], data_range=1.0))
    assert ssim(other, image) == pytest.approx(expected, abs=1e-12)


def test_ssim_names_what_it_cannot_compare():
    with pytest.raises(ValueError, match=r"needs images of at least 6×6 px, got 5×9"):
        ssim(np.zeros((5, 9)), np.zeros((5, 9)))
    with pytest.raises(ValueError, match=r"one shape, got \(8, 8\) and \(8, 9\)"):
        ssim(np.zeros((8, 8)), np.zeros((8, 9)))


def test_frame_changes_by_hand():
    video = np.stack([np.full((2, 2, 3), value) for value in (0.0, 0.5, 0.25, 0.25)])
    video[3, 0, 0, 0] = 1.0  # one of 12 values moves by 0.75
    assert frame_changes(video).tolist() == pytest.approx([0.5, 0.25, 0.75 / 12])


# --- per-frame fidelity ---------------------------------------------------------------------------


def test_one_bad_frame_is_the_worst_frame_and_flicker_is_set_beside_one_devices():
    reference = moving_square()
    video = reference.copy()
    video[3] = np.clip(video[3] + 0.1, 0, 1)
    (score,) = video_fidelity([video], [reference], with_lpips=False)
    frame_psnr, frame_ssim = score["frames"]["psnr_db"], score["frames"]["ssim"]
    assert len(frame_psnr) == len(frame_ssim) == FRAMES
    assert [math.isinf(value) for value in frame_psnr] == [True, True, True, False, True, True]
    assert score["psnr_db_worst"] == frame_psnr[3] == pytest.approx(20.0, abs=0.1)  # a 0.1 shift: 20 dB
    assert score["ssim_worst"] == frame_ssim[3] < 1 and score["worst_frame"] == 3
    assert score["ssim"] == pytest.approx(np.mean(frame_ssim)) and math.isinf(score["psnr_db"])
    assert score["flicker_one_device"] == pytest.approx(frame_changes(reference).mean())
    assert score["flicker"] > score["flicker_one_device"], "a frame that jumps and back is flicker"
    assert score["lpips"] is None and len(score["changes"]) == len(score["changes_one_device"]) == FRAMES - 1


def test_video_prompts_are_moving_scenes_in_the_video_models_words():
    assert bench_prompts(len(VIDEO_SCENES) + 1, video=True) == [*VIDEO_SCENES, VIDEO_SCENES[0]]
    assert all(" moving from " in prompt for prompt in VIDEO_SCENES)
    from paradiff.builtin import unknown_words

    assert all(unknown_words(prompt, kind="video") == [] for prompt in VIDEO_SCENES)


# --- figures and the report -----------------------------------------------------------------------


def test_frame_strip_and_preview_layout():
    assert frame_indices(16) == [0, 2, 4, 6, 9, 11, 13, 15] and frame_indices(3) == [0, 1, 2]
    reference = moving_square()
    runs = [("one device", reference), ("patch warmup=1", reference * 0.9), ("cfg", reference)]
    strip = frame_strip(runs)
    assert strip.dtype == np.uint8 and strip.ndim == 3
    assert strip.shape[0] > 5 * (SIZE + GAP), "one device, then each parallel run and its difference: 5 rows"
    # the cfg run equals one device: its difference row (the last) is all inferno black; the patch run's is not
    tops = [strip.shape[0] - GAP - SIZE - row_from_bottom * (SIZE + GAP) for row_from_bottom in (2, 0)]
    patch_colours, cfg_colours = (
        {tuple(pixel) for pixel in strip[top : top + SIZE, strip.shape[1] // 2 :].reshape(-1, 3)} - {(255, 255, 255)}
        for top in tops
    )
    assert cfg_colours == {(0, 0, 4)} and len(patch_colours) > 1
    small = moving_square(size=STRIP_TILE)
    big = small.repeat(2, axis=1).repeat(2, axis=2)
    strips = [frame_strip([("one device", video), ("patch", np.clip(video + 0.05, 0, 1))]) for video in (small, big)]
    assert strips[0].shape == strips[1].shape, "frames above STRIP_TILE px are shrunk to it in the strip"
    assert np.abs(strips[0].astype(int) - strips[1]).max() <= 1, "each pixel the mean of the 2×2 it covers"
    frames = preview_frames(runs)
    assert len(frames) == FRAMES and len({frame.shape for frame in frames}) == 1
    assert not np.array_equal(frames[0], frames[1]), "the square moves"


def made_up_results() -> BenchResults:
    """Two prompts; 'patch warmup=1' flickers (every other frame brightened), 'cfg' equals one device."""
    references = [moving_square(seed=seed) for seed in (0, 1)]
    flickering = [video.copy() for video in references]
    for video in flickering:
        video[1::2] = np.clip(video[1::2] + 0.05, 0, 1)
    runs = []
    for spec, videos in [
        (ONE_DEVICE, references),
        (RunSpec("patch", 1), flickering),
        (RunSpec("cfg"), references),
    ]:
        run = RunResult(spec)
        for video in videos:
            run.add(video, 1.0 if spec.strategy is None else 0.5, {"bytes_per_step": 1e6, "wait_s": 0.1})
        runs.append(run)
    prompts = ["a red circle", "a blue square"]
    return BenchResults(prompts, runs, world_size=2, device="cpu")


def made_up_job(out) -> BenchJob:
    return BenchJob("some-video-model", ("patch", "cfg"), (1,), 2, 2, 3, None, 0, 1, str(out))


def test_video_report_has_per_frame_figures_flicker_strips_and_previews(tmp_path, monkeypatch):
    plotted = []
    monkeypatch.setattr(report, "speedup_psnr_plot", lambda points, path, ylabel: plotted.append((points, ylabel)))
    results = made_up_results()
    lines = write_report(made_up_job(tmp_path), results)
    assert " | worst-frame SSIM | LPIPS | flicker | added flicker |" in lines[0]

    document = json.loads((tmp_path / "results.json").read_text())
    rows = {row["run"]: row for row in document["rows"]}
    assert list(rows) == ["one device", "patch warmup=1", "cfg"]
    assert document["config"]["frames"] == FRAMES and document["config"]["size"] == SIZE
    flickering, exact = rows["patch warmup=1"], rows["cfg"]
    assert 20 < flickering["psnr_db_worst"] < 40 and flickering["ssim_worst"] < flickering["ssim"] < 1
    assert [value is None for value in flickering["per_frame"]["psnr_db"]] == [True, False] * (FRAMES // 2)
    assert flickering["per_prompt"][0]["worst_frame"] % 2 == 1 and len(flickering["changes"]) == FRAMES - 1
    baseline_flicker = rows["one device"]["flicker"]
    assert all(row["flicker_one_device"] == baseline_flicker for row in rows.values())
    assert flickering["flicker_added"] == pytest.approx(flickering["flicker"] - baseline_flicker)
    assert 0.04 < flickering["flicker_added"] <= 0.05, "every frame step moves by 0.05 more, bar the square"
    assert exact["flicker_added"] == 0
    assert exact["psnr_db"] is None and exact["psnr_db_worst"] is None and exact["ssim_worst"] == 1
    assert "grid" not in exact, "videos get strips and previews, not the image grids"
    [(points, ylabel)] = plotted
    assert points == [("patch warmup=1", 2.0, flickering["psnr_db_worst"]), ("cfg", 2.0, math.inf)]
    assert ylabel.startswith("worst-frame PSNR"), "identical only when every frame is: the worst frame is plotted"

    video = document["video"]
    assert video == {
        "frames": FRAMES,
        "strips": ["frames-1.png", "frames-2.png"],
        "previews": ["preview-1.mp4", "preview-2.mp4"],
        "flicker_plot": "flicker.png",
    }
    for name in [*video["strips"], "flicker.png"]:
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG"
    videos = [(row, run.outputs[0]) for row, run in zip(rows, results.runs, strict=True)]
    preview = iio.imread(tmp_path / "preview-1.mp4")
    assert preview.shape[0] == FRAMES and preview.shape[1] % 16 == preview.shape[2] % 16 == 0
    assert preview.shape[1:3] == tuple(16 * -(-side // 16) for side in preview_frames(videos)[0].shape[:2])

    markdown = (tmp_path / "report.md").read_text()
    assert "| " + " | ".join(VIDEO_TABLE_HEADERS) + " |" in markdown
    assert "| patch warmup=1 | 0.50 | 2.00× | 1.00 | 0.10 |" in markdown
    assert "![frames, prompt 2](frames-2.png)" in markdown and "(preview-1.mp4)" in markdown
    assert "| frame | patch warmup=1 PSNR dB | patch warmup=1 SSIM | cfg PSNR dB | cfg SSIM |" in markdown
    assert f"| {FRAMES} | " in markdown and "![flicker](flicker.png)" in markdown
    page = (tmp_path / "report.html").read_text()
    for name in ("preview-1.mp4", "preview-2.mp4", "flicker.png"):
        assert f'src="{name}"' in page
    assert '<video src="preview-2.mp4"' in page
    assert "<th>worst-frame PSNR dB</th>" in page and "<th>cfg SSIM</th>" in page


# --- the whole bench on 2 ranks -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bench_of_a_video_pipeline_on_two_ranks(pool2, tmp_path):
    folder = save("cogvideox-text", tmp_path / "cogvideox")
    out = tmp_path / "report"
    out.mkdir()  # as job_from_args does
    job = BenchJob(str(folder), ("patch", "cfg"), (1,), 2, 1, 2, None, 0, 1, str(out))
    results = pool2.run(bench_on_rank, job)[0]
    assert [run.spec.label for run in results.runs] == ["one device", "patch warmup=1", "cfg"]
    assert results.prompts == [VIDEO_SCENES[0]], "a video pipeline gets moving scenes"
    assert {run.outputs[0].shape for run in results.runs} == {(8, 32, 32, 3)}, "the pipeline's own 8 frames"
    write_report(job, results)
    rows = json.loads((out / "results.json").read_text())["rows"]
    for row in rows[1:]:
        assert 0.99 < row["ssim_worst"] <= row["ssim"] <= 1 and len(row["per_frame"]["ssim"]) == 8
        assert abs(row["flicker_added"]) < 1e-3 and row["flicker"] > 0
    assert (out / "preview-1.mp4").is_file() and (out / "frames-1.png").is_file()
