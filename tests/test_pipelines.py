"""The ``pipelines/`` recipes end to end: each one a ``torchrun`` job on 2 CPU ranks, as their docs launch them.

They run as real ``torchrun`` jobs, not on the shared rank pools, because the launch is part of what
they document. They run one after the other: started together, five jobs' ten ranks and their polling
waits share two cores and take three times as long.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def _run_recipe(launcher: list[str], recipe: str, tmp_path) -> str:
    """Run ``recipe`` on 2 ranks started by ``launcher``; check its image and report; its stdout."""
    command = [
        *launcher,
        *(str(ROOT / "pipelines" / recipe), "--model", MODELS[recipe], "--size", str(SIZE), "--steps", "2"),
        *("--out", str(tmp_path / "image.png")),
    ]
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        job = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=_env(), cwd=tmp_path)
    try:
        code = job.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(job)
        pytest.fail(f"{recipe} did not finish in {JOB_TIMEOUT_S} s")
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert code == 0, stderr[-3000:]
    with Image.open(tmp_path / "image.png") as image:
        assert image.format == "PNG" and image.size == (SIZE, SIZE) and image.mode == "RGB"
    assert stdout.count("wrote ") == 1, stdout  # rank 0 alone saves and reports
    assert "steps in" in stdout and "MB/step sent" in stdout, stdout
    return stdout


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("recipe", MODELS)
def test_recipe_on_two_ranks(tmp_path, recipe):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run_recipe(torchrun, recipe, tmp_path)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_recipe_runs_under_accelerate_launch(tmp_path):
    """accelerate's launcher sets the same environment as torchrun (``--multi_gpu`` starts the processes the same
    way on CPUs); the recipe's ranks find each other through it."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    stdout = _run_recipe(launcher, "pixart.py", tmp_path)
    assert "on 2 rank(s)" in stdout, stdout


@pytest.mark.timeout(120)
def test_unknown_strategy_is_refused():
    command = [sys.executable, str(ROOT / "pipelines" / "sd3.py"), "--model", "tiny", "--strategy", "tiles"]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=100)
    assert done.returncode == 2
    assert "argument --strategy: invalid choice: 'tiles' (choose from" in done.stderr, done.stderr
