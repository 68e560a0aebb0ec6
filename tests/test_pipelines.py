"""The ``pipelines/`` recipes end to end on 2 CPU ranks, as their docs launch them.

Two run as real jobs, because the launch is part of what they document: one under ``torchrun``, one under
``accelerate launch``. The others run their script on the ranks of a shared pool with the environment torchrun
sets, which tests the recipe, not the launcher again, without two more workers importing torch and diffusers.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from cli_ranks import as_torchrun_rank
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]

#: The ``--model`` each recipe runs here: the built-in pipelines for SD and PixArt, tiny configs otherwise.
MODELS = {
    "stable_diffusion.py": "paradiff-tiny",
    "sdxl.py": "tiny",
    "pixart.py": "paradiff-tiny-dit",
    "sd3.py": "tiny",
    "flux.py": "tiny",
}
#: The recipes run by the launchers themselves; the others run on a pool.
UNDER_TORCHRUN, UNDER_ACCELERATE = "stable_diffusion.py", "pixart.py"
SIZE = 64
JOB_TIMEOUT_S = 240


def _env() -> dict[str, str]:
    """The environment with this checkout first on the path, so the recipes import its paradiff, installed or not."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _stop(job: subprocess.Popen) -> None:
    """SIGTERM first: torchrun forwards it to its workers, which run in sessions of their own."""
    job.terminate()
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


def _recipe_argv(recipe: str, tmp_path) -> list[str]:
    return [
        *(str(ROOT / "pipelines" / recipe), "--model", MODELS[recipe], "--size", str(SIZE), "--steps", "2"),
        *("--out", str(tmp_path / "image.png")),
    ]


def _check_output(stdout: str, tmp_path) -> None:
    """The recipe's image and report."""
    with Image.open(tmp_path / "image.png") as image:
        assert image.format == "PNG" and image.size == (SIZE, SIZE) and image.mode == "RGB"
    assert stdout.count("wrote ") == 1, stdout  # rank 0 alone saves and reports
    assert "steps in" in stdout and "MB/step sent" in stdout, stdout


def _run_recipe(launcher: list[str], recipe: str, tmp_path) -> str:
    """Run ``recipe`` on 2 ranks started by ``launcher``; check its image and report; its stdout."""
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        job = subprocess.Popen(
            [*launcher, *_recipe_argv(recipe, tmp_path)], stdout=stdout, stderr=stderr, env=_env(), cwd=tmp_path
        )
    try:
        code = job.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(job)
        pytest.fail(f"{recipe} did not finish in {JOB_TIMEOUT_S} s")
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert code == 0, stderr[-3000:]
    _check_output(stdout, tmp_path)
    return stdout


def _recipe_on_rank(argv: list[str]) -> str:
    """The recipe script ``argv[0]`` on this rank, with the variables torchrun sets; what it printed."""
    saved = list(sys.argv), list(sys.path)
    sys.argv, sys.path[:0] = argv, [str(Path(argv[0]).parent)]
    sys.modules.pop("_recipe", None)  # it reads the rank when imported
    out = io.StringIO()
    try:
        with as_torchrun_rank(), contextlib.redirect_stdout(out):
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved
    return out.getvalue()


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_recipe_runs_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run_recipe(torchrun, UNDER_TORCHRUN, tmp_path)


@pytest.mark.timeout(JOB_TIMEOUT_S)
@pytest.mark.parametrize("recipe", [recipe for recipe in MODELS if recipe not in (UNDER_TORCHRUN, UNDER_ACCELERATE)])
def test_recipe_on_two_ranks(pool2, tmp_path, recipe):
    _check_output(pool2.run(_recipe_on_rank, _recipe_argv(recipe, tmp_path), timeout_s=JOB_TIMEOUT_S)[0], tmp_path)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_recipe_runs_under_accelerate_launch(tmp_path):
    """accelerate's launcher sets the same environment as torchrun (``--multi_gpu`` starts the processes the same
    way on CPUs); the recipe's ranks find each other through it."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    stdout = _run_recipe(launcher, UNDER_ACCELERATE, tmp_path)
    assert "on 2 rank(s)" in stdout, stdout


def test_unknown_strategy_is_refused(capsys, monkeypatch):
    script = str(ROOT / "pipelines" / "sd3.py")
    monkeypatch.setattr(sys, "argv", [script, "--model", "tiny", "--strategy", "tiles"])
    monkeypatch.syspath_prepend(str(ROOT / "pipelines"))
    monkeypatch.delitem(sys.modules, "_recipe", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --strategy: invalid choice: 'tiles' (choose from" in err, err
