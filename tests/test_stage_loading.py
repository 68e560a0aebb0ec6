"""Loading only this rank's stage of the blocks (``paradiff.load_stage_pipeline``) for ``pipefusion`` and
``dualparal``, from a local pipeline folder: the whole denoiser is never in memory, and the image (or video) is the
one of the whole model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from exactness import TOLERANCE, relative_error
from patch_cases import generate

import paradiff
from paradiff.errors import ParadiffError
from paradiff.loading import load_pipeline
from paradiff.stages.load_stage import load_stage_pipeline, loaded_stage
from paradiff.tiny import build_pipeline, prompt_inputs, save
from paradiff.tiny.forcing import df_call

STEPS = 2


def _held_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")


def save_tiny(family: str, folder: str) -> None:
    build_pipeline(family).save_pretrained(folder)


def stage_loaded_against_whole(folder: str, family: str) -> dict:
    """The whole pipeline's one-device image; then the pipeline loaded by stage, what it held, its image."""
    whole = load_pipeline(folder)
    inputs = prompt_inputs(whole, family)
    reference = generate(whole, inputs, 64, STEPS, output_type="latent")
    whole_bytes = _held_bytes(whole.transformer)
    pipe = load_stage_pipeline(folder, device="cpu")
    held = loaded_stage(pipe.transformer)
    loaded_bytes = _held_bytes(pipe.transformer)
    pipe = paradiff.parallelize(pipe, strategy="pipefusion", warmup_steps=STEPS)
    try:
        image = generate(pipe, inputs, 64, STEPS, output_type="latent")
        after_bytes = _held_bytes(pipe.transformer)
    finally:
        paradiff.unparallelize(pipe)
    restored = generate(pipe, inputs, 64, STEPS, output_type="latent")
    return {
        "rank": dist.get_rank(),
        "stages": held.stages,
        "stage": held.stage,
        "whole_bytes": whole_bytes,
        "loaded_bytes": loaded_bytes,
        "after_bytes": after_bytes,
        "shared_bytes": sum(
            t.numel() * t.element_size() for n, t in whole.transformer.named_parameters() if n in held.shared
        ),
        "difference": relative_error(image, reference),
        "restored_difference": relative_error(restored, reference),
        "whole_again": loaded_stage(pipe.transformer) is None and _held_bytes(pipe.transformer) == whole_bytes,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_each_rank_loads_its_stage_only_and_draws_the_whole_models_image(pool2, tmp_path, family):
    folder = str(tmp_path / family)
    save_tiny(family, folder)
    results = pool2.run(stage_loaded_against_whole, folder, family)
    assert [r["stage"] for r in results] == [0, 1]
    stages = results[0]["stages"]
    assert len(stages) == 2 and all(r["stages"] == stages for r in results)
    whole, shared = results[0]["whole_bytes"], results[0]["shared_bytes"]
    loaded = [r["loaded_bytes"] for r in results]
    assert all(shared < held < whole for held in loaded)
    assert sum(loaded) - shared == whole  # the stages' blocks once each, the shared layers on both ranks
    assert all(r["after_bytes"] == r["loaded_bytes"] for r in results)  # parallelize loads and frees nothing more
    for result in results:
        assert result["difference"] <= TOLERANCE
        assert result["whole_again"] and result["restored_difference"] <= TOLERANCE


def refused(folder: str, **options) -> str:
    pipe = load_stage_pipeline(folder, device="cpu")
    try:
        paradiff.check_parallelize(pipe, world_size=2, **options)
    except ParadiffError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(
    "options",
    [dict(strategy="patch"), dict(strategy="pipefusion", pipefusion_stages=(1, 3)), dict(strategy="cfg")],
    ids=["other-strategy", "other-cut", "cfg"],
)
def test_a_stage_loaded_pipeline_runs_only_as_it_was_loaded(tmp_path, monkeypatch, options):
    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = str(tmp_path / "pixart")
    save_tiny("pixart", folder)
    message = refused(folder, **options)
    assert "holds only stage 0 of its blocks" in message
    assert "runs only with strategy='pipefusion' on 2 ranks" in message
    assert refused(folder, strategy="pipefusion") == "accepted"


def test_a_stage_loaded_pipeline_cannot_run_exact_calls_in_row_bands(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = str(tmp_path / "pixart")
    save_tiny("pixart", folder)
    message = refused(folder, strategy="pipefusion", pipefusion_sync="sequence")
    assert "pipefusion_sync='sequence' runs every block on every rank" in message and "load the whole" in message


def test_loading_by_stage_needs_stages_and_safetensors(tmp_path):
    folder = tmp_path / "pixart"
    save_tiny("pixart", str(folder))
    with pytest.raises(ParadiffError, match="needs at least 2 pipeline stages"):
        load_stage_pipeline(str(folder), device="cpu", world_size=1)
    with pytest.raises(ParadiffError, match="does not cut this model's 2 blocks into 2 stages"):
        load_stage_pipeline(str(folder), device="cpu", world_size=2, rank=0, pipefusion_stages=(1, 2))
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").rename(folder / "elsewhere")
    with pytest.raises(ParadiffError, match="holds no diffusion_pytorch_model.safetensors"):
        load_stage_pipeline(str(folder), device="cpu", world_size=2, rank=0)


def dualparal_stage_loaded_against_whole(folder: str) -> dict:
    """``dualparal`` (fresh) on the whole pipeline, then on the pipeline loaded by stage for it: what each held, and
    the two videos."""
    whole = load_pipeline(folder)
    whole.set_progress_bar_config(disable=True)
    whole_bytes = _held_bytes(whole.transformer)
    whole = paradiff.parallelize(whole, strategy="dualparal", dualparal_displaced=False)
    reference = whole(**df_call()).frames
    paradiff.unparallelize(whole)
    pipe = load_stage_pipeline(folder, strategy="dualparal", device="cpu")
    pipe.set_progress_bar_config(disable=True)
    loaded_bytes = _held_bytes(pipe.transformer)
    loaded_stage_of_pipe = loaded_stage(pipe.transformer).stage
    pipe = paradiff.parallelize(pipe, strategy="dualparal", dualparal_displaced=False)
    try:
        video = pipe(**df_call()).frames
    finally:
        paradiff.unparallelize(pipe)
    return {
        "stage": loaded_stage_of_pipe,
        "loaded_after": loaded_stage(pipe.transformer) is not None,
        "whole_bytes": whole_bytes,
        "loaded_bytes": loaded_bytes,
        "equal": torch.equal(video, reference),
        "whole_again": _held_bytes(pipe.transformer) == whole_bytes,
    }


@pytest.mark.timeout(300)
def test_dualparal_loads_its_stage_only_and_makes_the_whole_models_video(pool2, tmp_path):
    folder = str(tmp_path / "skyreels-df")
    save("skyreels-df", folder)
    results = pool2.run(dualparal_stage_loaded_against_whole, folder)
    assert [r["stage"] for r in results] == [0, 1]
    whole = results[0]["whole_bytes"]
    assert all(r["loaded_bytes"] < whole for r in results) and sum(r["loaded_bytes"] for r in results) > whole
    assert all(r["equal"] and r["whole_again"] and not r["loaded_after"] for r in results)  # whole again after
    with pytest.raises(ParadiffError, match="pipefusion_stages is an option of strategy='pipefusion'"):
        load_stage_pipeline(folder, strategy="dualparal", pipefusion_stages=(2, 2), world_size=2, rank=0)
