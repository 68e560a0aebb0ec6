"""`paradiff bench` end to end on 2 ranks, its bad-input messages, and the report's pieces."""

from __future__ import annotations

import json
import math
import shlex
import sys

import numpy as np
import pytest
from cli_ranks import cli_on_ranks
from PIL import Image
from rank_workers import RankFailure

from paradiff import cli
from paradiff.bench import fidelity as fidelity_module
from paradiff.bench import report
from paradiff.bench.fidelity import fidelity, lpips_unavailable_reason
from paradiff.bench.figures import GAP, comparison_grid, difference_heatmap, speedup_psnr_plot
from paradiff.bench.job import ONE_DEVICE, BenchJob, RunSpec
from paradiff.bench.prompts import SCENES, bench_prompts
from paradiff.bench.report import _json_safe, metrics_line, summary_json, write_report_files
from paradiff.bench.run import BenchResults, RunResult, bench_on_rank
from paradiff.cli.bench_options import job_from_args

MODEL = "paradiff-tiny"
#: The built-in U-Net's own size, which bench uses without --size: on 2 ranks, bands of 8 of its 16 latent rows.
SIZE = 128
BENCH = ["bench", "--model", MODEL, "--steps", "3", "--prompts", "2", "--warmup", "1,3"]
RUNS = ["one device", "patch warmup=1", "patch warmup=3", "patch floor=30 dB", "cfg"]


@pytest.mark.timeout(240)
def test_bench_on_two_ranks_writes_every_report_file(pool2, tmp_path):
    """On the shared pool, as under torchrun (the next test starts its own workers)."""
    out = tmp_path / "report"
    argv = [*BENCH, "--strategies", "patch,cfg", "--fidelity-floor", "30", "--out", str(out)]
    code, stdout, stderr = cli_on_ranks(pool2, *argv, env={"PARADIFF_CACHE_DIR": str(tmp_path / "cache")})
    assert code == 0, stderr[-3000:]
    assert "[bench] 3/5 patch warmup=3: prompt 2/2 ..." in stdout

    results = json.loads((out / "results.json").read_text())
    rows = {row["run"]: row for row in results["rows"]}
    assert list(rows) == RUNS, "cfg is exact: it runs once, not once per warm-up"
    for row in rows.values():
        for key in ("latency_s", "speedup", "bytes_per_step", "wait_s", "ssim"):
            assert math.isfinite(row[key]), (row["run"], key)
        assert len(row["per_prompt"]) == 2
    baseline = rows["one device"]
    assert baseline["speedup"] == 1.0 and baseline["psnr_db"] is None and baseline["ssim"] == 1.0
    displaced = rows["patch warmup=1"]
    assert displaced["bytes_per_step"] > 0 and 20 < displaced["psnr_db"] < 200
    scores = [prompt["psnr_db"] for prompt in displaced["per_prompt"]]
    assert displaced["psnr_db_worst"] == min(scores) < max(scores), "the worst prompt's, not the mean"
    assert rows["cfg"]["psnr_db"] is None or rows["cfg"]["psnr_db"] > 80, "the cfg split is exact"
    guarded = rows["patch floor=30 dB"]
    assert guarded["fidelity_floor_db"] == 30 and guarded["warmup"] is None and guarded["psnr_db"] >= 30
    assert "--fidelity-floor 30" in results["config"]["command"]
    assert results["config"]["nproc"] == 2 and results["config"]["size"] == SIZE
    if results["lpips"] != "ok":
        assert results["lpips"].startswith("skipped: ") and "LPIPS skipped: " in stdout

    page = (out / "report.html").read_text()
    assert results["config"]["command"] in page and "patch warmup=1" in page
    for image in ("speedup-vs-psnr.png", displaced["grid"], rows["patch warmup=3"]["grid"]):
        assert (out / image).is_file() and f'src="{image}"' in page
    markdown = (out / "report.md").read_text()
    assert "| patch warmup=3 |" in markdown and " | PSNR dB | worst-prompt PSNR dB | SSIM |" in markdown


def test_a_size_the_ranks_cannot_split_fails_on_every_rank_before_the_baseline(pool2, tmp_path):
    args = cli.build_parser().parse_args([*BENCH, "--size", "96", "--out", str(tmp_path)])
    with pytest.raises(RankFailure) as failure:
        pool2.run(bench_on_rank, job_from_args(args, threads=1))
    assert sorted([*failure.value.failures, *failure.value.pending]) == [0, 1]  # pending: slower than the grace
    for traceback in failure.value.failures.values():
        assert "in _preflight" in traceback and "ParadiffError: height 96 is not divisible by" in traceback


@pytest.fixture
def no_workers(monkeypatch):
    """Bad input must be refused before any worker starts."""

    def refuse(*args):
        raise AssertionError("workers were started")

    monkeypatch.setattr(cli, "run_on_ranks", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--prompts", "0"], "--prompts must be at least 1, got 0"),
        (["--strategies", "patch,tiles"], "unknown strategy 'tiles'; available: patch"),
        (["--strategies", ""], "--strategies takes a comma-separated list without empty items, got ''"),
        (["--warmup", "1,,4"], "--warmup takes a comma-separated list without empty items"),
        (["--warmup", "1,two"], "--warmup takes integers >= 0 (synchronous steps after the first), got 'two'"),
        (["--warmup", "-1"], "--warmup takes integers >= 0"),
        (["--fidelity-floor", "30,0"], "--fidelity-floor takes positive numbers of dB (e.g. 30,40), got '0'"),
        (["--fidelity-floor", "high"], "--fidelity-floor takes positive numbers of dB (e.g. 30,40), got 'high'"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--nproc", "1"], "bench compares N ranks with one device; use --nproc 2 or more, got 1"),
        (["--guidance", "inf"], "--guidance must be a finite number, got inf"),
        (["--guidance", "nan"], "--guidance must be a finite number, got nan"),
        (["--prompt", "a red circle"], "--prompts N draws N built-in scenes; leave it out with --prompt"),
    ],
)
def test_bad_input(capsys, no_workers, tmp_path, argv, message):
    assert cli.main([*BENCH, "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_ranks_refuse_a_world_a_strategy_cannot_run_before_anything_else(capsys, ranks_here, tmp_path):
    argv = [*BENCH, "--out", str(tmp_path), "--nproc", "3", "--device", "cpu", "--strategies", "patch,cfg"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "strategy='cfg' runs the two CFG halves on 2 ranks, got a world of 3" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read --prompts-file {file}: No such file or directory"),
        ("\n  \n", "--prompts-file {file} holds no"),
    ],
)
def test_a_missing_or_empty_prompts_file(capsys, no_workers, tmp_path, content, message):
    file = tmp_path / "prompts.txt"
    if content is not None:
        file.write_text(content)
    argv = ["bench", "--model", MODEL, "--prompts-file", str(file), "--out", str(tmp_path / "report")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(file=file) in err and err.count("\n") == 1, err


def test_an_out_folder_that_cannot_be_created(capsys, no_workers, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert cli.main([*BENCH, "--out", str(blocker / "report")]) == 2
    assert f"cannot create the --out folder {blocker / 'report'}" in capsys.readouterr().err


@pytest.mark.parametrize("size", [[], ["--size", "64"]])
def test_the_recorded_command_reproduces_the_job(tmp_path, size):
    args = cli.build_parser().parse_args([*BENCH, "--out", str(tmp_path), "--warmup", "4,1,4", *size])
    job = job_from_args(args, threads=1)
    assert job.warmups == (4, 1) and job.size == (int(size[1]) if size else 128)  # the built-in U-Net's own size
    assert [spec.label for spec in job.runs()] == ["one device", "patch warmup=4", "patch warmup=1"]
    again = cli.build_parser().parse_args(shlex.split(job.command())[1:])
    assert job_from_args(again, threads=again.threads) == job


def test_prompts_cycle_through_the_scenes():
    prompts = bench_prompts(len(SCENES) + 2)
    assert prompts[: len(SCENES)] == list(SCENES) and prompts[len(SCENES) :] == list(SCENES[:2])


def test_prompts_use_only_words_the_builtin_model_knows():
    scenes = pytest.importorskip("paradiff.builtin.scenes")
    assert {word for prompt in SCENES for word in prompt.split()} <= set(scenes.VOCABULARY)


def test_fidelity_of_identical_and_of_different_images():
    rng = np.random.default_rng(0)
    images = [rng.random((32, 32, 3)) for _ in range(2)]
    changed = [np.clip(image + 0.01 * rng.standard_normal(image.shape), 0, 1) for image in images]
    same, different = fidelity(images, images, with_lpips=False), fidelity(changed, images, with_lpips=False)
    assert all(s["psnr_db"] == math.inf and s["ssim"] == pytest.approx(1.0) and s["lpips"] is None for s in same)
    assert all(30 < d["psnr_db"] < 50 and d["ssim"] < 1.0 for d in different)


def test_grid_has_one_row_per_prompt_and_three_columns():
    references = [np.zeros((16, 24, 3)), np.ones((16, 24, 3))]
    images = [np.full((16, 24, 3), 0.5), np.ones((16, 24, 3))]
    grid = comparison_grid(images, references)
    assert grid.shape == (2 * 16 + 3 * GAP, 3 * 24 + 4 * GAP, 3) and grid.dtype == np.uint8
    heatmap = difference_heatmap(images[1], references[1])
    assert heatmap.shape == (16, 24, 3) and np.all(heatmap == heatmap[0, 0])  # identical: one colour
    assert not np.array_equal(difference_heatmap(images[0], references[0]), heatmap)


def test_plot_takes_identical_runs(tmp_path):
    speedup_psnr_plot([("patch warmup=1", 1.6, 42.0), ("patch warmup=20", 1.1, math.inf)], tmp_path / "plot.png")
    with Image.open(tmp_path / "plot.png") as image:
        assert image.format == "PNG"


def test_json_has_no_infinities():
    assert _json_safe({"a": [math.inf, 1.5, (math.nan,)], "b": "x"}) == {"a": [None, 1.5, [None]], "b": "x"}


def test_a_missing_bench_extra_is_named(capsys, no_workers, tmp_path, monkeypatch):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    assert cli.main([*BENCH, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "paradiff bench needs matplotlib" in err and "pip install 'paradiff[bench]'" in err


def test_the_recorded_command_reproduces_the_users_workload(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a blue square\n\n  a green circle  \n")
    workload = ["--guidance", "3.25", "--negative-prompt", "a red 'x'", "--dtype", "bfloat16", "--device", "cpu"]
    argv = ["bench", "--model", MODEL, "--out", str(tmp_path), "--prompt", "a red circle", "--prompts-file"]
    job = job_from_args(cli.build_parser().parse_args([*argv, str(prompts), *workload]), threads=1)
    assert job.prompt_list() == ["a red circle", "a blue square", "a green circle"] and job.prompts == 3
    assert (job.guidance, job.negative_prompt, job.dtype, job.device) == (3.25, "a red 'x'", "bfloat16", "cpu")
    command = shlex.split(job.command())
    assert "--prompts" not in command and command.count("--prompt") == 3, "the file's prompts are spelled out"
    again = cli.build_parser().parse_args(command[1:])
    assert job_from_args(again, threads=again.threads) == job
    default = job_from_args(cli.build_parser().parse_args(["bench", "--out", str(tmp_path)]), threads=1)
    assert default.prompts == 4 and default.prompt_list() == list(SCENES[:4])


@pytest.mark.timeout(240)
def test_bench_on_the_default_model_with_the_users_prompt_as_json(capfd, tmp_path):
    """The default model (PixArt, DPM-Solver++), whose one-step path the preflight image must not take."""
    out = tmp_path / "report"
    argv = ["bench", "--nproc", "2", "--steps", "4", "--size", "256", "--strategies", "cfg", "--out", str(out)]
    workload = ["--prompt", "a small blue square in the center on a black background", "--guidance", "3"]
    assert cli.main([*argv, *workload, "--dtype", "float32", "--device", "cpu", "--json"]) == 0, capfd.readouterr().err
    captured = capfd.readouterr()
    summary = json.loads(captured.out)  # nothing but the JSON object on stdout
    assert "[bench] 2/2 cfg: prompt 1/1 ..." in captured.err, "--json: the progress lines go to stderr"
    assert summary["out"] == str(out) and {f"{out}/{name}" for name in ("report.html", "results.json")} <= set(
        summary["files"]
    )
    assert all((out / name).is_file() for name in summary["files"]) and str(out / "grid-cfg.png") in summary["files"]
    one, cfg = summary["rows"]
    assert set(one) == set(report.JSON_ROW_KEYS)
    assert (one["run"], one["strategy"], one["warmup"], one["speedup"]) == ("one device", None, None, 1.0)
    assert cfg["strategy"] == "cfg" and cfg["bytes_per_step"] > 0 and cfg["latency_s"] > 0 and cfg["ssim"] > 0.99
    assert (cfg["lpips"] is None) == ("LPIPS" not in summary["metrics"]) and summary["metrics"][:2] == ["PSNR", "SSIM"]

    config = json.loads((out / "results.json").read_text())["config"]
    assert config["prompts"] == [workload[1]] and not config["builtin_prompts"]
    assert (config["guidance"], config["dtype"], config["device_option"], config["size"]) == (
        3.0,
        "float32",
        "cpu",
        256,
    )
    assert summary["command"] == config["command"] and "--guidance 3.0" in config["command"]
    assert "--prompt 'a small blue square" in config["command"]
    assert metrics_line(lpips_unavailable_reason()) in (out / "report.md").read_text()


def made_up_image_job(out) -> tuple[BenchJob, BenchResults]:
    rng = np.random.default_rng(0)
    images = [rng.random((16, 16, 3)) for _ in range(2)]
    runs = []
    for strategy, outputs in [(None, images), ("patch", [np.clip(image + 0.01, 0, 1) for image in images])]:
        run = RunResult(ONE_DEVICE if strategy is None else RunSpec(strategy, 1))
        for output in outputs:
            run.add(output, 1.0 if strategy is None else 0.5, {} if strategy is None else {"bytes_per_step": 2e6})
        runs.append(run)
    job = BenchJob(MODEL, ("patch",), (1,), 2, 2, 3, 16, 0, 1, str(out))
    return job, BenchResults(["a red circle", "a blue square"], runs, world_size=2, device="cpu", dtype="float32")


def test_every_report_says_which_metrics_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "lpips_unavailable_reason", lambda: "no backbone here")
    written = write_report_files(*made_up_image_job(tmp_path))
    line = "metrics: PSNR, SSIM; LPIPS skipped: no backbone here"
    assert line in written.lines
    assert line in (tmp_path / "report.md").read_text() and line in (tmp_path / "report.html").read_text()
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["metrics"] == ["PSNR", "SSIM"] and document["lpips"] == "skipped: no backbone here"
    summary = summary_json(written)
    assert summary["metrics"] == ["PSNR", "SSIM"] and [row["lpips"] for row in summary["rows"]] == [None, None]
    assert summary["rows"][0]["psnr_db"] is None, "identical: PSNR is infinite, null in JSON"
    assert summary["rows"][1]["speedup"] == 2.0 and summary["rows"][1]["bytes_per_step"] == 2e6
    assert metrics_line(None) == "metrics: PSNR, SSIM, LPIPS"


def test_the_layout_a_run_took_is_in_its_row(tmp_path):
    """``asyncdiff``'s cut, measured in the run (``comm_stats``' ``layout``), is in its row of results.json and
    beside its label in the tables, so the run can be repeated on it; a run without one has null."""
    job, results = made_up_image_job(tmp_path)
    asyncdiff = RunResult(RunSpec("asyncdiff", 1))
    for output in results.runs[1].outputs:
        asyncdiff.add(output, 0.5, {"bytes_per_step": 2e6, "layout": {"asyncdiff_cut": [3, 3]}})
    results.runs.append(asyncdiff)
    write_report_files(job, results)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [row["layout"] for row in rows] == [None, None, {"asyncdiff_cut": [3, 3]}]
    for table in ("report.md", "report.html"):
        text = (tmp_path / table).read_text()
        assert text.count("(asyncdiff_cut=(3, 3))") == 1 and "patch warmup=1 (" not in text, table


def test_lpips_names_a_torchvision_that_does_not_import(monkeypatch):
    real = fidelity_module.importlib.util.find_spec
    monkeypatch.setattr(
        fidelity_module.importlib.util, "find_spec", lambda name: object() if name == "torchvision" else real(name)
    )
    monkeypatch.setitem(sys.modules, "torchvision", None)  # importing it raises ImportError
    reason = lpips_unavailable_reason()
    assert reason.startswith("torchvision does not import beside torch ") and "torchvision" in reason.split(": ", 1)[1]


def test_a_torchvision_that_breaks_torchmetrics_is_named(capsys, no_workers, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchmetrics.functional.image", None)  # importing it raises ImportError
    assert cli.main([*BENCH, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        "paradiff bench cannot import torchmetrics' image metrics (ModuleNotFoundError: " in err
        and err.count("\n") == 1
    )


@pytest.mark.parametrize("command", [[*BENCH, "--out", "{tmp}"], ["plan", "--model", MODEL]])
def test_timeout_reaches_the_ranks_of_bench_and_plan(monkeypatch, tmp_path, command):
    """--timeout is the process group's timeout and, under bench, each parallelize call's ``timeout_s``."""
    from datetime import timedelta

    given = {}

    def stop(fn, nproc, job, **options):
        given.update(options, job=job)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_on_ranks", stop)
    argv = [part.replace("{tmp}", str(tmp_path)) for part in command]
    assert cli.main([*argv, "--timeout", "5"]) == 130
    assert given["timeout"] == timedelta(seconds=5) and given["job"].timeout_s == 5
