"""`paradiff generate` end to end on 2 ranks, its bad-input messages, its output, and the from_pretrained path."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_ranks import cli_on_ranks
from PIL import Image
from scene_analysis import background_of
from test_docs import README, README_FIRST

import paradiff
from paradiff.builtin.follow import judge
from paradiff.cli import build_parser, main
from paradiff.cli.summary import format_bytes, format_fidelity, format_speedup, summary_lines
from paradiff.launch.quiet import quiet_output
from paradiff.loading import DEFAULT_STEPS, TRAINED_MODELS, default_size, default_steps, load_pipeline
from paradiff.metrics import psnr
from paradiff.tiny import build_pipeline, prompt_inputs, save

#: The picture the README shows under its first command: ``![...](path)``.
README_PICTURE = re.compile(r"!\[[^\]]*\]\((samples/[^)]+\.png)\)")

#: Bad input must be refused before any image is drawn: loading the model on 2 ranks takes seconds, drawing
#: the one-device reference would show its labelled progress bar. The bound is loose: the 2 cores are shared.
REFUSAL_BOUND_S = 60


def run_cli(*argv: str, timeout: int = 280, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "paradiff.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def cli_env(tmp_path, **extra: str) -> dict:
    """The environment with the logs of failed runs going to ``tmp_path``."""
    return {**os.environ, "TMPDIR": str(tmp_path), **extra}


#: What third-party packages print when they are not silenced (warnings, deprecations, loading bars).
THIRD_PARTY_NOISE = re.compile(r"warn|deprecat|Beautiful Soup|Expected types|Loading|torchvision", re.IGNORECASE)


@pytest.mark.timeout(300)
def test_generate_on_two_ranks_with_the_builtin_model(tmp_path):
    """The README's first command as written (tests/test_docs.py leaves it to this test), and what it prints."""
    words = shlex.split(README_FIRST)
    assert words[:2] == ["paradiff", "generate"] and words[-2] == "--out", README_FIRST
    out = tmp_path / words[-1]
    done = run_cli(*words[1:], env=cli_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with Image.open(out) as image:  # the built-in DiT at 256 px under cfg
        assert image.format == "PNG" and image.size == (256, 256) and image.mode == "RGB"
        drawn = np.asarray(image, dtype=np.float64)
    assert background_of(drawn.astype(np.uint8)) == "white", "the picture follows the prompt"
    shown = README_PICTURE.search(README.read_text())
    assert shown, "the README shows the picture its first command draws"
    with Image.open(README.parent / shown.group(1)) as image:
        picture = np.asarray(image.convert("RGB"), dtype=np.float64)
    psnr_db = psnr(drawn, picture, data_range=255)
    assert psnr_db >= 40, f"the README's picture is not what its first command draws now ({psnr_db:.1f} dB)"
    assert all(judge(picture.astype(np.uint8), words[2]).values()), "the follow measure reads it as its prompt"
    lines = done.stdout.splitlines()
    assert lines[0] == f"wrote {words[-1]}" and len(lines) == 5, done.stdout
    assert re.fullmatch(r"one device: \d+\.\d\d s", lines[1]), lines
    speed = r"(\d+\.\d× (faster|slower)|as fast as one device)"
    exact = r"(identical to one device|equal to one device within float round-off \(PSNR \d+ dB\))"
    assert re.fullmatch(rf"2 ranks, cfg: \d+\.\d\d s, {speed}, {exact}", lines[2]), lines
    assert re.fullmatch(r"traffic: \d+(\.\d)? kB per step per rank, \d+\.\d\d s waiting for other ranks", lines[3])
    peak = r"peak memory per rank \(MB\): loading \d+ / \d+, generating \d+ / \d+ \(whole model loaded\)"
    assert re.fullmatch(peak, lines[4]), lines
    # quiet: only rank 0's two labelled step bars on stderr, no third-party message, no loading bar
    assert not THIRD_PARTY_NOISE.search(done.stderr), done.stderr[-3000:]
    bars = {line.split(":")[0] for line in re.split(r"[\r\n]+", done.stderr) if line.strip()}
    assert bars == {"one device", "2 ranks, cfg"}, done.stderr[-3000:]
    assert not list(tmp_path.glob("paradiff-*")), "no log or store folder is left after a good run"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--frames", "8"],
            "--frames is for video pipelines, and paradiff-tiny-dit (PixArtAlphaPipeline) makes images",
        ),
        (["--out", "{tmp}/x.mp4"], "--out {tmp}/x.mp4 is a file for videos, and paradiff-tiny-dit"),
        (["--out", "/proc/x.png"], "cannot write /proc/x.png"),
        (["--model", "nobody/nothing"], "hub model nobody/nothing is not in the local Hugging Face cache"),
    ],
    ids=["frames-image", "mp4-image", "proc", "offline-hub"],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_is_drawn(tmp_path, argv, message):
    """Refused by the ``paradiff`` command itself, before it starts any worker."""
    argv = [part.replace("{tmp}", str(tmp_path)) for part in argv]
    out = ["--out", str(tmp_path / "x.png")] if "--out" not in argv else []
    start = time.monotonic()
    done = run_cli("generate", "a red circle", "--steps", "2", *argv, *out, env=cli_env(tmp_path, HF_HUB_OFFLINE="1"))
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("paradiff: error: ") and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert message.replace("{tmp}", str(tmp_path)) in done.stderr
    assert "one device" not in done.stderr and done.stdout == "", "no reference was drawn"
    assert elapsed < REFUSAL_BOUND_S
    left = [path.name for path in tmp_path.iterdir() if path.name.startswith("paradiff") or path.suffix]
    assert left == [], "no output, log or store is left"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "paradiff-tiny", "--strategy", "patch", "--size", "136"], "height 136 is not divisible by 64"),
        (["--size", "136"], "height 136 is not a multiple of 16 pixels (a row of PixArtTransformer2DModel's"),
        (["--model", "paradiff-tiny", "--strategy", "pipefusion"], "strategy='pipefusion' does not support UNet2DCon"),
    ],
    ids=["size-136", "size-136-dit", "pipefusion-unet"],
)
def test_what_the_loaded_model_cannot_run_is_one_line_and_exit_2_on_every_rank(pool2, tmp_path, argv, message):
    """Checked once the pipeline is loaded, on every rank alike (here as under torchrun), before any drawing. How a
    rank's ParadiffError comes back through the command's own workers: tests/test_cli_launch.py."""
    out = tmp_path / "x.png"
    code, stdout, stderr = cli_on_ranks(pool2, "generate", "a red circle", "--steps", "2", *argv, "--out", str(out))
    assert code == 2 and stderr.startswith("paradiff: error: ") and stderr.count("\n") == 1, stderr
    assert message in stderr and stdout == "" and "one device" not in stderr
    assert not out.exists()


@pytest.mark.timeout(300)
def test_pipefusion_without_the_reference_loads_each_ranks_stage_only(pool2, tmp_path):
    out = tmp_path / "circle.png"
    argv = ["--strategy", "pipefusion", "--no-baseline", "--steps", "2", "--size", "256", "--out", str(out)]
    code, stdout, stderr = cli_on_ranks(pool2, "generate", "a red circle", *argv)
    assert code == 0, stderr[-3000:]
    peak = r"peak memory per rank \(MB\): loading \d+ / \d+, generating \d+ / \d+ \(each rank loaded only its stage"
    assert re.match(peak, stdout.splitlines()[-1]), stdout


@pytest.mark.timeout(300)
def test_generate_holds_a_fidelity_floor_and_calibrates_once_per_size(pool2, tmp_path):
    """`--fidelity-floor 35` under `patch`: the picture is within 35 dB of one device's; the first run says what it
    refreshed and what calibrating cost (apart from the times), a later run of the size reuses the calibration.

    The floor leaves room for the second prompt: the threshold is calibrated on the first with a 1 dB margin, and
    the same refreshed steps (1-3) draw the first prompt 43 dB from one device and the second 39 dB."""
    argv = ["--strategy", "patch", "--fidelity-floor", "35", "--steps", "8", "--size", "128", "--json"]
    env = {"PARADIFF_CACHE_DIR": str(tmp_path / "cache")}
    reports = []
    for prompt in ("a large red circle at the top left", "a small blue square at the bottom"):
        code, stdout, stderr = cli_on_ranks(
            pool2, "generate", prompt, *argv, "--out", str(tmp_path / f"{len(reports)}.png"), env=env
        )
        assert code == 0, stderr[-3000:]
        reports.append(json.loads(stdout))
    first, later = reports
    for report in reports:
        assert report["psnr_db"] >= 35 and report["fidelity_floor_db"] == 35 and 1 in report["refreshed_steps"]
    assert first["calibration_seconds"] > 0 and later["calibration_seconds"] == 0
    assert (tmp_path / "cache" / "fidelity_floor.json").is_file()


@pytest.mark.timeout(120)
def test_video_pipelines_write_mp4_and_refuse_an_image_file(tmp_path, capsys):
    import imageio.v3 as iio

    folder = save("cogvideox-text", tmp_path / "cogvideox")
    capsys.readouterr()  # save_pretrained's own bars
    argv = ["a red circle", "--model", str(folder), "--nproc", "1", "--steps", "2", "--frames", "5", "--size", "32"]
    assert main(["generate", *argv, "--out", str(tmp_path / "clip.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file for images, and" in err and "makes videos: use .mp4, .gif" in err
    assert main(["generate", *argv, "--out", str(tmp_path / "clip.mp4")]) == 0
    frames = iio.imread(tmp_path / "clip.mp4")
    assert frames.shape == (8, 32, 32, 3), "5 frames round up to CogVideoX's 4k + 1 latent frames: 8 decoded"
    assert not (tmp_path / "clip.png").exists()
    assert capsys.readouterr().out.splitlines()[-2].startswith("one device: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--size", "100"], "--size must be a positive multiple of 8, got 100"),
        (["--frames", "0"], "--frames must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--warmup", "-1"], "--warmup must be at least 0"),
        (["--guidance", "-1"], "--guidance must be 0 or more"),
        (["--out", "/nonexistent/dir/x.png"], "cannot write /nonexistent/dir/x.png"),
        (["--out", "x.png.txt"], "--out x.png.txt: paradiff writes images as .png"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--call", "causal_block_size"], "--call takes KEY=VALUE, e.g. --call causal_block_size=5; got"),
        (["--call", "height=64"], "--call height=...: height is set by --size; use that instead"),
        (["--width", "100"], "--width must be a positive multiple of 8, got 100"),
        (["--guidance", "inf"], "--guidance must be a finite number, got inf"),
        (["--guidance", "nan"], "--guidance must be a finite number, got nan"),
        (["--seed", "1e23"], "--seed must be an integer from 0 to 2**64 - 1, got 99999999999999991611392"),
        (["--seed", "-1"], "--seed must be an integer from 0 to 2**64 - 1, got -1"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        (["--nproc", "1000"], "--nproc 1000: this machine has"),
    ],
)
def test_bad_input(capsys, monkeypatch, argv, message):
    """Refused in the parent before any worker starts (none may start: run_on_ranks would fail the test)."""
    monkeypatch.setattr("paradiff.cli.run_on_ranks", _no_workers)
    assert main(["generate", "a prompt", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("cfg", "strategy='cfg' runs the two CFG halves on 2 ranks, got a world of 3; launch 2 ranks, or a"),
        ("patch", None),  # runs on 3: the ranks go on to make their group
    ],
)
def test_the_ranks_refuse_a_world_the_strategy_cannot_run_before_anything_else(capsys, ranks_here, strategy, message):
    """The world size is the ranks' check (the parent would have to import the strategy, and diffusers, for it)."""
    code = main(["generate", "a prompt", "--nproc", "3", "--strategy", strategy])
    err = capsys.readouterr().err
    if message is None:
        assert code == 1 and "a process group was made" in err, err
        return
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert "cfg_parallel=True to run" not in err, "no layout that is itself refused on 3 ranks"


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker was started")


def test_unknown_strategy_is_rejected_by_the_parser_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "a prompt", "--strategy", "tiles"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'tiles'" in err and err.count("\n") == 1


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(
        rf"paradiff {re.escape(paradiff.__version__)} \(torch \S+, diffusers \S+\)\n", capsys.readouterr().out
    )


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_shows_the_defaults(capsys, command):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS denoising steps (default: 8 for paradiff-tiny-video, 20 otherwise)" in text
    assert "--nproc NPROC how many processes (ranks) to start, one per GPU (default: every visible GPU, or 2" in text
    assert re.search(r"\(default: paradiff-tiny- ?dit\)", text), "help wraps after a hyphen"
    assert "--seed SEED seed of the initial noise (default: 0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    unwrapped = text.replace("- ", "-")  # help wraps after a hyphen
    for option, default, otherwise in (("steps", default_steps, DEFAULT_STEPS), ("size", default_size, None)):
        shown = re.search(rf"--{option} {option.upper()} [^(]*\(default: ([^)]*)\)", unwrapped).group(1)
        named = {
            model: int(value)
            for value, models in re.findall(r"(\d+) for (paradiff-[\w-]+(?: and paradiff-[\w-]+)*)", shown)
            for model in models.split(" and ")
        }
        assert all(named.get(model, otherwise) == default(model) for model in TRAINED_MODELS), (option, shown)
    if command == "generate":
        for shown in (
            "(default: cfg for the built-in models, patch otherwise)",
            "(default 4; 0 with --fidelity-floor)",
            "(default: auto, CUDA when present",
            "(default: auto, float16 on",
        ):
            assert shown in text, shown
        assert "--allow-pickle" in text and "--negative-prompt" in text and "--guidance" in text


def test_quiet_output_shows_paradiffs_own_warnings_only_and_restores_everything(capfd, recwarn):
    import logging
    import warnings

    filters = list(warnings.filters)
    with quiet_output(verbose=False):
        warnings.warn("a third-party deprecation", FutureWarning, stacklevel=1)
        logging.getLogger("diffusers.pipelines").warning("a third-party log")
        logging.getLogger("somewhere.else").warning("a log of an unknown package")
        warnings.warn("a word the model does not know", paradiff.ParadiffWarning, stacklevel=1)
    assert capfd.readouterr().err == "paradiff: warning: a word the model does not know\n"
    assert [str(warning.message) for warning in recwarn] == [], "the third-party warning was ignored, not recorded"
    assert warnings.filters == filters and "TRANSFORMERS_VERBOSITY" not in os.environ
    with quiet_output(verbose=True), pytest.warns(FutureWarning):
        warnings.warn("shown with --verbose", FutureWarning, stacklevel=1)


def test_a_cli_run_shows_paradiff_warnings_and_runs_the_reference_in_the_same_dtype(tmp_path, capsys):
    argv = ["generate", "a red circle", "--model", "paradiff-tiny", "--nproc", "1", "--steps", "2", "--size", "32"]
    argv += ["--dtype", "float16"]
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    assert "paradiff: warning: --dtype float16 on the CPU is slow" in err and not THIRD_PARTY_NOISE.search(
        err.replace("paradiff: warning:", "")
    )


@pytest.mark.parametrize(
    ("speedup", "words"),
    [
        (1.8, "1.8× faster"),
        (0.25, "4.0× slower"),
        (0.43, "2.3× slower"),
        (1.02, "as fast as one device"),
        (3.0, "3.0× faster"),
    ],
)
def test_speedup_in_words(speedup, words):
    assert format_speedup(speedup) == words


def test_fidelity_and_traffic_in_words():
    assert format_fidelity(math.inf) == "identical to one device"
    assert format_fidelity(145.3) == "equal to one device within float round-off (PSNR 145 dB)"
    assert format_fidelity(41.26) == "PSNR 41.3 dB against one device"
    assert [format_bytes(n) for n in (512, 26_000, 467_000, 33_400_000, 1.2e9)] == [
        "512 B",
        "26.0 kB",
        "467 kB",
        "33.4 MB",
        "1.2 GB",
    ]


def test_summary_lines():
    report = {"files": ["x.png"], "latency_s": 0.4, "baseline_s": 0.1, "speedup": 0.25, "psnr_db": math.inf}
    report.update(bytes_per_step=26_000, wait_s=0.12)
    assert summary_lines(report, "2 ranks, cfg") == [
        "wrote x.png",
        "one device: 0.10 s",
        "2 ranks, cfg: 0.40 s, 4.0× slower, identical to one device",
        "traffic: 26.0 kB per step per rank, 0.12 s waiting for other ranks",
    ]
    assert summary_lines({"files": ["x.png"], "latency_s": 0.5}, "one device") == ["wrote x.png", "one device: 0.50 s"]
    two = {"files": ["x-1.png", "x-2.png"], "latency_s": 0.5, "baseline_s": 0.5, "speedup": 1.0, "psnr_db": 30.0}
    assert summary_lines(two, "2 ranks, patch")[::2] == [
        "wrote 2 files: x-1.png, x-2.png",
        "2 ranks, patch: 0.50 s, as fast as one device, PSNR 30.0 dB against one device (the least close picture)",
    ]


def test_from_pretrained_on_a_local_folder(tmp_path):
    built = build_pipeline("sd")
    built.save_pretrained(tmp_path)
    loaded = load_pipeline(str(tmp_path))
    assert type(loaded) is type(built)
    inputs = prompt_inputs(loaded, "sd")
    images = loaded(**inputs, height=64, width=64, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)


def test_call_arguments_reach_the_pipeline_call_and_unknown_ones_are_named():
    from paradiff.loading import call_arguments, prompt_kwargs
    from paradiff.tiny import build_pipeline

    extra = call_arguments(["eta=0.5", "clip_skip=1", "cross_attention_kwargs={}", "eta=0.25", "prompt_2=a cat"])
    assert extra == (("eta", 0.25), ("clip_skip", 1), ("cross_attention_kwargs", {}), ("prompt_2", "a cat"))
    pipe = build_pipeline("sd")
    inputs = prompt_kwargs(pipe, "random-sd", "a prompt", extra=extra[:3])
    assert (inputs["eta"], inputs["clip_skip"], inputs["cross_attention_kwargs"]) == (0.25, 1, {})
    named = r"--call prompt_2=\.\.\.: StableDiffusionPipeline takes no argument 'prompt_2'; it takes "
    with pytest.raises(paradiff.ParadiffError, match=named):
        prompt_kwargs(pipe, "random-sd", "a prompt", extra=extra)


def test_width_draws_a_non_square_image(tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "wide.png"
    argv = ["a red circle", "--model", "paradiff-tiny", "--nproc", "1", "--steps", "2", "--size", "64", "--width", "96"]
    assert main(["generate", *argv, "--out", str(out)]) == 0
    assert Image.open(out).size == (96, 64)  # PIL: (width, height)


VIDEO = "paradiff-tiny-video"


class _Captured(Exception):
    """Raised by the launcher stand-in below once it has the job the command would start."""


@pytest.mark.parametrize("command", ["generate", "bench", "plan"])
def test_a_run_without_steps_takes_the_models_own(monkeypatch, tmp_path, command):
    """``--steps`` left out: 8 for the built-in video model, 20 for a picture model; given, the number given."""

    def launch(fn, nproc, job, **kwargs):
        raise _Captured(job)

    monkeypatch.setattr(paradiff.cli, "run_on_ranks", launch)
    monkeypatch.chdir(tmp_path)
    for model, given, steps in ((VIDEO, [], 8), ("paradiff-tiny-dit", [], 20), (VIDEO, ["--steps", "5"], 5)):
        prompt = ["a red circle moving from left to right"] if command == "generate" else []
        out = ["--out", "clip.mp4" if model == VIDEO else "picture.png"] if command == "generate" else []
        args = build_parser().parse_args([command, *prompt, "--model", model, *given, *out])
        with pytest.raises(_Captured) as captured:
            args.func(args)
        assert captured.value.args[0].steps == steps, (command, model, given)


def test_a_server_without_steps_serves_the_models_own():
    from paradiff.cli.serve_command import settings_from

    for model, given, steps in ((VIDEO, [], 8), ("paradiff-tiny", [], 20), (VIDEO, ["--steps", "5"], 5)):
        assert settings_from(build_parser().parse_args(["serve", "--model", model, *given])).steps == steps
    with pytest.raises(paradiff.ParadiffError, match="--steps 30 is above --max-steps 25"):
        settings_from(build_parser().parse_args(["serve", "--model", VIDEO, "--steps", "30", "--max-steps", "25"]))
