"""Safe loading: safetensors only unless pickled weights are allowed, no code shipped with a model ever runs,
and a model that cannot be found says why in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline

from paradiff import ParadiffError
from paradiff.cli import main
from paradiff.loading import check_model, load_pipeline

MODEL = "paradiff-tiny"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The built-in U-Net pipeline saved twice: with pickled weights only, and with safetensors."""
    root = tmp_path_factory.mktemp("saved")
    pipe = load_pipeline(MODEL)
    pipe.save_pretrained(root / "pickled", safe_serialization=False)
    pipe.save_pretrained(root / "safe")
    return {"pickled": root / "pickled", "safe": root / "safe", "unet": pipe.unet.state_dict()}


def test_the_pickled_folder_really_holds_pickled_weights(folders):
    # transformers 5 writes safetensors whatever it is asked: the text encoder's stay safe
    for component in ("unet", "vae"):
        assert [path.suffix for path in (folders["pickled"] / component).glob("*.*") if path.suffix != ".json"] == [
            ".bin"
        ]


def test_pickled_weights_are_refused_naming_the_flag(folders):
    with pytest.raises(ParadiffError, match="--allow-pickle") as refusal:
        load_pipeline(str(folders["pickled"]))
    assert "allow_pickle=True" in str(refusal.value) and "\n" not in str(refusal.value)


def test_pickled_weights_load_when_allowed(folders):
    pipe = load_pipeline(str(folders["pickled"]), allow_pickle=True)
    assert isinstance(pipe, StableDiffusionPipeline)
    for name, value in pipe.unet.state_dict().items():
        assert torch.equal(value, folders["unet"][name]), name


def test_safetensors_load(folders):
    pipe = load_pipeline(str(folders["safe"]), dtype=torch.bfloat16)
    assert isinstance(pipe, StableDiffusionPipeline) and pipe.unet.dtype == torch.bfloat16


def test_the_cli_refuses_pickled_weights_in_one_line_and_loads_them_with_allow_pickle(folders, tmp_path, capsys):
    argv = ["generate", "a red circle", "--model", str(folders["pickled"]), "--nproc", "1", "--steps", "1"]
    out = tmp_path / "x.png"
    assert main([*argv, "--size", "32", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("paradiff: error: ") and "--allow-pickle" in err
    assert not out.exists()
    assert main([*argv, "--size", "32", "--out", str(out), "--allow-pickle"]) == 0
    assert out.is_file()


class _RunsCode:
    """Unpickled, it creates ``marker``: what a pickled weights file can do to whoever loads it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture
def trapped(tmp_path, folders):
    """The safe folder but for its U-Net, whose weights are a pickle (its real weights and an object that creates
    a marker file when unpickled): ``(folder, the U-Net's weights file, marker)``."""
    folder = tmp_path / "trapped"
    shutil.copytree(folders["safe"], folder)
    for path in (folder / "unet").glob("*.safetensors"):
        path.unlink()
    weights, marker = folder / "unet" / "diffusion_pytorch_model.bin", tmp_path / "code-ran"
    torch.save({**folders["unet"], "payload": _RunsCode(marker)}, weights)
    return folder, weights, marker


@pytest.fixture
def unpickled(monkeypatch):
    """The files ``torch.load`` opens, with it unpickling them as a loader that trusts pickles does.

    diffusers asks torch for ``weights_only=True``, whose restricted unpickler refuses the marker's object too:
    a second line of defence, not paradiff's. Without it the marker shows what paradiff's own refusal stops."""
    opened = []
    load = torch.load

    def trusting_load(f, *args, **kwargs):
        opened.append(Path(f))
        return load(f, *args, **{**kwargs, "weights_only": False})

    monkeypatch.setattr(torch, "load", trusting_load)
    return opened


def test_pickled_weights_are_never_unpickled_without_allow_pickle(trapped, unpickled):
    folder, weights, marker = trapped
    with pytest.raises(ParadiffError, match="--allow-pickle") as refusal:
        load_pipeline(str(folder))
    assert "\n" not in str(refusal.value)
    assert unpickled == [] and not marker.exists()
    # the same file with allow_pickle: unpickled, it runs its code (and the model loads)
    pipe = load_pipeline(str(folder), allow_pickle=True)
    assert unpickled == [weights] and marker.exists()
    assert isinstance(pipe, StableDiffusionPipeline)


def test_a_pickle_torchs_safe_unpickler_refuses_is_named_so_not_corrupt(trapped):
    """With allow_pickle, diffusers still unpickles with ``weights_only=True``, which refuses the marker's object:
    the file is whole, so the message says what refused it."""
    folder, weights, marker = trapped
    with pytest.raises(ParadiffError) as refusal:
        load_pipeline(str(folder), allow_pickle=True)
    message = str(refusal.value)
    assert "torch's safe unpickler (weights_only=True) refuses" in message and "corrupt" not in message, message
    assert not marker.exists()


def test_the_cli_never_unpickles_weights_without_allow_pickle(trapped, unpickled, tmp_path, capsys):
    folder, weights, marker = trapped
    out = tmp_path / "x.png"
    argv = ["generate", "a red circle", "--model", str(folder), "--nproc", "1", "--steps", "2", "--size", "32"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("paradiff: error: ") and "--allow-pickle" in err
    assert unpickled == [] and not marker.exists() and not out.exists()
    assert main([*argv, "--out", str(out), "--allow-pickle"]) == 0
    assert unpickled == [weights] and marker.exists() and out.is_file()


def _with_code(tmp_path, folders, component: str | None):
    """A copy of the safe folder whose pipeline (component None) or ``component`` is a class of its own code."""
    folder = tmp_path / "custom"
    shutil.copytree(folders["safe"], folder)
    marker = tmp_path / "code-ran"
    index = json.loads((folder / "model_index.json").read_text())
    module_dir = folder if component is None else folder / component
    (module_dir / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from diffusers import StableDiffusionPipeline, UNet2DConditionModel\n"
        "class Custom(StableDiffusionPipeline):\n    pass\nclass CustomUNet(UNet2DConditionModel):\n    pass\n"
    )
    if component is None:
        index["_class_name"] = ["custom_code", "Custom"]
    else:
        index[component] = ["custom_code", "CustomUNet"]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder, marker


@pytest.mark.parametrize("component", [None, "unet"])
def test_code_shipped_with_a_model_never_runs(tmp_path, folders, component):
    folder, marker = _with_code(tmp_path, folders, component)
    with pytest.raises(ParadiffError, match="never runs code"):
        load_pipeline(str(folder), allow_pickle=True)
    if component is None:  # a custom pipeline class is refused before any worker starts, too
        with pytest.raises(ParadiffError, match="never runs code"):
            check_model(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("./no/such/folder", "no pipeline folder ./no/such/folder: not found"),
        ("no-such-model", "unknown model 'no-such-model'"),
        ("nobody/nothing", "hub model nobody/nothing is not in the local Hugging Face cache, and the hub is off"),
    ],
)
def test_a_model_that_cannot_be_found_says_why(monkeypatch, model, message):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ParadiffError, match=message):
        check_model(model)


def test_a_folder_without_a_model_index(tmp_path):
    with pytest.raises(ParadiffError, match="holds no model_index.json: not a diffusers pipeline folder"):
        check_model(str(tmp_path))


def test_where_a_model_comes_from_is_decided_in_one_place(tmp_path):
    from paradiff.loading import model_source

    trained = model_source("paradiff-tiny-video")
    assert (trained.kind, trained.builtin, Path(trained.location).name) == ("trained", "video", "video")
    assert (model_source("random-pixart").kind, model_source("random-pixart").location) == ("random", None)
    assert model_source(str(tmp_path)).kind == "folder" and model_source(str(tmp_path)).location == str(tmp_path)
    assert model_source("owner/name").kind == "hub"
    with pytest.raises(ParadiffError, match="unknown model 'no such model'"):
        model_source("no such model")


def test_a_frame_count_the_denoiser_cannot_draw_is_refused_with_the_count_it_can():
    """Latte's transformer draws exactly its ``video_length`` frames; AnimateDiff's motion modules any count up to
    their ``motion_max_seq_length``."""
    from paradiff.loading import frames_refusal
    from paradiff.tiny import table

    latte, animatediff = table.pipeline("latte"), table.pipeline("animatediff")
    length, most = latte.transformer.config.video_length, animatediff.unet.config.motion_max_seq_length
    assert frames_refusal(latte, length) is None
    assert frames_refusal(latte, length + 1) == (
        f"draws {length} frames (its transformer's video_length); use --frames {length} or drop --frames"
    )
    assert frames_refusal(animatediff, 1) is None and frames_refusal(animatediff, most) is None
    assert frames_refusal(animatediff, most + 1) == (
        f"draws at most {most} frames (its motion modules' motion_max_seq_length); use --frames {most} or fewer"
    )
