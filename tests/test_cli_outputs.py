"""What ``paradiff generate`` writes: every picture, numbered; never over a file unasked; never half a file.
And the faults of loading and of the call's arguments, each in one line naming its cause."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cli_ranks import cli_on_ranks
from PIL import Image

import paradiff
from paradiff.builtin import pipeline_folder
from paradiff.cli import main, output_files
from paradiff.cli.output_files import output_paths, write_outputs
from paradiff.loading import load_pipeline, prompt_kwargs, warn_if_cut

#: One rank, the built-in U-Net at a small size, 2 steps: a picture costs well under a second.
CHEAP = ["--model", "paradiff-tiny", "--nproc", "1", "--steps", "2", "--size", "32"]


def test_several_prompts_and_images_per_prompt_go_to_numbered_files_named_in_json(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a small blue square in the center on a black background\n\na red circle\n")
    argv = ["generate", "a large red circle at the top left on a white background", "--prompts-file", str(prompts)]
    argv += [*CHEAP, "--call", "num_images_per_prompt=2", "--out", str(tmp_path / "scene.png"), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    files = [str(tmp_path / f"scene-{number}.png") for number in range(1, 7)]
    assert report["files"] == files and all(Path(name).is_file() for name in files)
    assert [picture["seed"] for picture in report["pictures"]] == [0, 0, 1, 1, 2, 2], "prompt i draws from seed + i"
    assert report["pictures"][2]["prompt"] == "a small blue square in the center on a black background"
    first, second = (np.asarray(Image.open(name)) for name in files[:2])
    assert not np.array_equal(first, second), "the two images of one prompt are two pictures, not one twice"
    assert report["seconds"] > 0 and report["nproc"] == 1 and report["strategy"] == "cfg"


def test_an_existing_output_is_kept_unless_overwrite_is_passed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "circle.png"
    out.write_bytes(b"the user's own file")
    monkeypatch.setattr("paradiff.cli.run_on_ranks", _no_workers)
    assert main(["generate", "a red circle", *CHEAP, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"paradiff: error: {out} exists; pass --overwrite to replace it, or name another --out\n"
    assert out.read_bytes() == b"the user's own file"
    monkeypatch.undo()
    assert main(["generate", "a red circle", *CHEAP, "--out", str(out), "--overwrite"]) == 0
    assert Image.open(out).size == (32, 32)


def test_a_folder_out_takes_the_default_names(tmp_path, capsys):
    assert main(["generate", "a red circle", "a blue square", *CHEAP, "--out", f"{tmp_path}/"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["paradiff-1.png", "paradiff-2.png"]
    assert capsys.readouterr().out.startswith(f"wrote 2 files: {tmp_path}/paradiff-1.png, {tmp_path}/paradiff-2.png")


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker was started")


def test_a_write_that_fails_leaves_the_earlier_file_whole_and_no_partial_file(tmp_path, monkeypatch):
    out = tmp_path / "circle.png"
    out.write_bytes(b"the earlier picture")

    def full_disk(output, path):
        Path(path).write_bytes(b"half a pic")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output_files, "_write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_outputs(np.zeros((1, 8, 8, 3)), [out])
    assert out.read_bytes() == b"the earlier picture"
    assert [path.name for path in tmp_path.iterdir()] == ["circle.png"], "no temporary file is left"


def test_numbered_names():
    assert output_paths("a/b.png", "image", 1) == [Path("a/b.png")]
    assert output_paths("a/b.gif", "video", 2) == [Path("a/b-1.gif"), Path("a/b-2.gif")]
    assert output_paths(None, "video", 1) == [Path("paradiff.mp4")]


@pytest.fixture(scope="module")
def corrupt_folder(tmp_path_factory) -> Path:
    """The built-in DiT with its transformer's weights cut in half, as by an interrupted download."""
    folder = tmp_path_factory.mktemp("corrupt") / "pixart"
    shutil.copytree(pipeline_folder("pixart"), folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    return folder


def test_a_truncated_safetensors_file_is_called_corrupt(corrupt_folder, tmp_path, capsys):
    argv = ["generate", "a red circle", "--model", str(corrupt_folder), "--nproc", "1", "--steps", "2"]
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    weights = corrupt_folder / "transformer" / "diffusion_pytorch_model.safetensors"
    assert err.startswith(f"paradiff: error: weights file {weights} is corrupt or truncated (") and err.count("\n") == 1
    assert "--allow-pickle" not in err, "a damaged safetensors file is no reason to load pickles"


def test_the_stage_loader_calls_a_truncated_file_corrupt(corrupt_folder, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(paradiff.ParadiffError, match=r"diffusion_pytorch_model.safetensors is corrupt or truncated"):
        paradiff.load_stage_pipeline(str(corrupt_folder), strategy="pipefusion")


@pytest.fixture(scope="module")
def unet_pipe():
    return load_pipeline("paradiff-tiny")


def test_a_call_value_of_the_wrong_kind_is_named(unet_pipe):
    with pytest.raises(paradiff.ParadiffError, match=r'--call eta="abc": StableDiffusionPipeline takes a number'):
        prompt_kwargs(unet_pipe, "paradiff-tiny", "a red circle", extra=(("eta", "abc"),))
    assert prompt_kwargs(unet_pipe, "paradiff-tiny", "a red circle", extra=(("eta", 1),))["eta"] == 1


def test_a_prompt_longer_than_the_text_encoder_reads_is_said(unet_pipe):
    with pytest.warns(paradiff.ParadiffWarning, match=r"the prompt is \d+ tokens long and StableDiffusionPipeline"):
        warn_if_cut(unet_pipe, "a red circle on a white background " * 6, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", paradiff.ParadiffWarning)
        warn_if_cut(unet_pipe, "a red circle on a white background", {})


def test_a_run_far_beyond_the_models_size_is_measured_before_the_first_step():
    """``--size 8192`` on the CPU: hours of denoising (traced on meta, nothing drawn), more than the other ranks
    wait for the one-device reference: refused; without the reference, said in a warning."""
    import torch

    from paradiff.cli.generate_job import GenerateJob, _run_length, plan_generate

    pipe = load_pipeline("paradiff-tiny-dit")
    fields = dict(prompts=("a red circle",), model="paradiff-tiny-dit", strategy="cfg", nproc=2, steps=20)
    job = GenerateJob(**fields, size=8192, frames=None, seed=0, warmup=4, out=None, baseline=True, threads=1)
    inputs = prompt_kwargs(pipe, job.model, "a red circle")
    plan = plan_generate(pipe, job, inputs)
    refused, message = _run_length(pipe, job, inputs, plan, torch.device("cpu"), torch.float32)
    assert refused and message.startswith("at 8192×8192 px, 20 steps on one cpu device take at least "), message
    waits = "longer than the other ranks wait for the one-device reference (--timeout 600 s); pass --no-baseline"
    assert waits in message
    least = message.split("take at least ")[1].split(" here")[0]
    assert least.endswith(" h") or (least.endswith(" min") and int(least.split()[0]) >= 10), least
    job = replace(job, baseline=False)
    refused, message = _run_length(pipe, job, inputs, plan, torch.device("cpu"), torch.float32)
    assert not refused and message.endswith("FLOP per denoiser call); a smaller --size is quicker"), message
    assert _run_length(pipe, replace(job, size=512), inputs, plan, torch.device("cpu"), torch.float32) is None


@pytest.mark.timeout(240)
def test_size_8192_on_two_cpu_ranks_is_refused_in_seconds_on_every_rank(pool2, tmp_path):
    out = tmp_path / "big.png"
    argv = ["generate", "a red circle", "--size", "8192", "--out", str(out)]
    code, stdout, stderr = cli_on_ranks(pool2, *argv)
    assert code == 2 and stderr.startswith("paradiff: error: at 8192×8192 px, 20 steps on one cpu device take at least")
    assert stderr.count("\n") == 1 and "one device:" not in stderr and stdout == "", stderr
    assert not out.exists()


def test_the_warning_of_a_long_run_comes_before_the_picture(tmp_path, capsys, monkeypatch):
    from paradiff.cli import generate_job as cli_generate

    monkeypatch.setattr(cli_generate, "LONG_RUN_S", 0.0)
    out = tmp_path / "big.png"
    argv = ["generate", "a red circle", "--model", "paradiff-tiny-dit", "--nproc", "1", "--steps", "2"]
    assert main([*argv, "--size", "640", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "at 640×640 px, 2 steps on one cpu device take at least " in err and "FLOP per denoiser call" in err
    assert "one-device reference" not in err, "one rank draws no reference"
    assert Image.open(out).size == (640, 640)
    assert main([*argv, "--size", "512", "--out", str(tmp_path / "own.png")]) == 0
    assert "take at least" not in capsys.readouterr().err, "at twice the model's own size, nothing is traced"
