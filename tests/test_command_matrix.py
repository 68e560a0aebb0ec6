"""Every command on every built-in model with default flags: ``generate`` under each strategy the model's
denoiser supports (and ``auto``), ``bench``, and ``plan`` timed here and with ``--hardware``.

Each cell runs ``paradiff.cli.main`` on the two ranks of a shared gloo pool, as under ``torchrun`` (the CLI's
own launch mode for a process group that already exists), so a cell costs its model's drawing rather than
starting and importing two workers. The CLI's own launcher (the parent that starts the workers) runs the
default model in tests/test_cli.py, tests/test_bench.py and tests/test_plan.py. Only the work is made small
(few steps, small pictures, one bench prompt); every other flag keeps its default.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_ranks import cli_on_ranks
from PIL import Image

from paradiff.builtin import FRAMES
from paradiff.loading import TRAINED_MODELS, model_index
from paradiff.models import FAMILIES
from paradiff.strategies import strategy_class, strategy_names

PROMPTS = {
    "paradiff-tiny": "a red circle",
    "paradiff-tiny-dit": "a red circle",
    "paradiff-tiny-video": "a red circle moving from left to right",
}
#: The smallest pictures every strategy splits on 2 ranks (the U-Net's bands go down 3 times: 64 px).
SIZE = "64"
#: Enough steps that the default warm-up (4) leaves a step on stale activations for the strategies that reuse them.
STEPS = "6"


def supported_strategies(model: str) -> list[str]:
    """The strategies that say they run ``model``'s denoiser, from the registry (ring among them: it is refused
    on CPU, and that refusal is its cell)."""
    index = model_index(model)
    denoiser = next(index[name][1] for name in ("transformer", "unet") if name in index)
    family = next(family for family in FAMILIES if denoiser in family.class_names)
    return [name for name in strategy_names() if strategy_class(name).supports(family)]


GENERATE_CELLS = [(model, strategy) for model in TRAINED_MODELS for strategy in [*supported_strategies(model), "auto"]]


def test_the_matrix_covers_every_builtin_model_and_the_strategies_that_run_them():
    assert list(TRAINED_MODELS) == ["paradiff-tiny", "paradiff-tiny-dit", "paradiff-tiny-video"]
    cells = {model: {s for m, s in GENERATE_CELLS if m == model} for model in TRAINED_MODELS}
    assert cells["paradiff-tiny"] >= {"patch", "parastep", "asyncdiff", "cfg", "auto"}
    assert cells["paradiff-tiny-dit"] >= {"patch", "pipefusion", "parastep", "asyncdiff", "cfg", "ulysses", "auto"}
    assert cells["paradiff-tiny-video"] >= {"patch", "parastep", "asyncdiff", "cfg", "auto"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "strategy"), GENERATE_CELLS, ids=[f"{m}-{s}" for m, s in GENERATE_CELLS])
def test_generate(pool2, tmp_path, model, strategy):
    video = TRAINED_MODELS[model] == "video"
    out = tmp_path / ("clip.mp4" if video else "picture.png")
    argv = ["generate", PROMPTS[model], "--model", model, "--strategy", strategy, "--steps", STEPS, "--size", SIZE]
    code, stdout, stderr = cli_on_ranks(pool2, *argv, "--out", str(out))
    if strategy == "ring":  # diffusers' only context-parallel attention on CPU cannot return what ring merges
        assert code == 2 and stderr.count("\n") == 1, stderr
        assert stderr.startswith("paradiff: error: strategy='ring' does not run on CPU"), stderr
        assert not out.exists()
        return
    assert code == 0, stderr[-3000:]
    if video:
        import imageio.v3 as iio

        assert iio.imread(out).shape == (FRAMES, int(SIZE), int(SIZE), 3)
    else:
        with Image.open(out) as image:
            assert image.format == "PNG" and image.size == (int(SIZE), int(SIZE))
            assert np.asarray(image).std() > 0, "a picture, not a blank"
    lines = stdout.splitlines()
    assert lines[0] == f"wrote {out}" and lines[1].startswith("one device: "), stdout
    assert lines[2].startswith(f"2 ranks, {strategy}: "), stdout
    if strategy == "auto":
        assert lines[3].startswith("auto picked "), stdout
    assert lines[-2].startswith("traffic: ") and lines[-1].startswith("peak memory per rank (MB): "), stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", TRAINED_MODELS)
def test_bench(pool2, tmp_path, model):
    out = tmp_path / "report"
    argv = ["bench", "--model", model, "--steps", STEPS, "--size", SIZE, "--prompts", "1", "--out", str(out)]
    code, stdout, stderr = cli_on_ranks(pool2, *argv)
    assert code == 0, stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [row["run"] for row in results["rows"]] == ["one device", "patch warmup=1", "patch warmup=4"]
    for row in results["rows"][1:]:
        assert row["speedup"] > 0 and row["bytes_per_step"] > 0, row
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    assert f"wrote {out / 'report.html'}" in stdout, stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", TRAINED_MODELS)
def test_plan_timed_here(pool2, model):
    code, stdout, stderr = cli_on_ranks(pool2, "plan", "--model", model, "--steps", STEPS, "--size", SIZE)
    assert code == 0, stderr[-3000:]
    assert "machine: measured here (on 2 ranks on cpu): one denoiser call " in stdout, stdout
    assert "fastest exact: " in stdout and "paradiff.parallelize(pipe, strategy=" in stdout, stdout
    assert "torchrun --nproc-per-node 2 " in stdout, stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", TRAINED_MODELS)
def test_plan_with_hardware(pool2, model):
    code, stdout, stderr = cli_on_ranks(pool2, "plan", "--model", model, "--hardware", "h100-nvlink", "--json")
    assert code == 0, stderr[-3000:]
    plan = json.loads(stdout)
    assert plan["model"] == model and plan["hardware"]["name"] == "h100-nvlink"
    strategies = {row["strategy"] for row in plan["predictions"]}
    assert strategies >= {"cfg", "patch"} and plan["fastest"]["strategy"] in strategies
    assert plan["parallelize"].startswith("paradiff.parallelize(pipe, strategy="), plan["parallelize"]
