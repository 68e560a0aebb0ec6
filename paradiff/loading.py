"""Which pipeline a ``--model`` name means, how to load it safely, and how to prompt it.

* ``paradiff-tiny`` (SD-style U-Net), ``paradiff-tiny-dit`` (PixArt-style DiT) and ``paradiff-tiny-video``
  (Latte, text to 16-frame video): the trained built-in pipelines shipped inside the package
  (:mod:`paradiff.builtin`), loaded with ``from_pretrained`` on their folder, offline.
* ``random-sd`` and ``random-pixart``: benchmark-sized pipelines with random weights built from
  configs (:mod:`paradiff.tiny`); they have no text encoder, so the prompt only seeds their
  conditioning embeddings.
* anything else: a local pipeline folder or a hub id, through ``DiffusionPipeline.from_pretrained``.

Loading is safe by default: weights load from safetensors only (pickled ``.bin``/``.pt`` weights can run
code when unpickled; ``allow_pickle=True``, the CLI's ``--allow-pickle``, lets them load), and code that
ships with a model (a custom pipeline or component class) never runs (``trust_remote_code=False``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import ParadiffError, ParadiffWarning

TRAINED_MODELS = {"paradiff-tiny": "sd", "paradiff-tiny-dit": "pixart", "paradiff-tiny-video": "video"}
RANDOM_MODELS = {"random-sd": "sd", "random-pixart": "pixart"}
#: ``generate``'s model: the built-in DiT, at a size where two CPU ranks beat one (see :func:`default_size`).
DEFAULT_MODEL = "paradiff-tiny-dit"
MODEL_NAMES = (*TRAINED_MODELS, *RANDOM_MODELS)
#: The command line's ``--steps`` when none is given, for a model without its own (:func:`default_steps`).
DEFAULT_STEPS = 20
#: A Hugging Face hub repository id: ``owner/name``.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: The flag that lets pickled weights load, named in the refusal.
ALLOW_PICKLE_FLAG = "--allow-pickle"


def _looks_like_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model or Path(model).exists()


@dataclass(frozen=True)
class ModelSource:
    """Where a ``--model`` comes from, decided once (:func:`model_source`) for every function that loads it."""

    #: ``trained`` (a built-in pipeline shipped with paradiff), ``random`` (random weights, built from configs),
    #: ``folder`` (a local pipeline folder) or ``hub`` (a Hugging Face hub id).
    kind: str
    #: What ``from_pretrained`` loads: the shipped folder, the local folder or the hub id; None for ``random``.
    location: str | None
    #: The built-in pipeline (``sd``, ``pixart``, ``video``) a trained or random model is.
    builtin: str | None = None


def model_source(model: str) -> ModelSource:
    """Where ``model`` comes from, or a :class:`ParadiffError` naming what ``--model`` takes."""
    if model in RANDOM_MODELS:
        return ModelSource("random", None, RANDOM_MODELS[model])
    if model in TRAINED_MODELS:
        from .builtin import pipeline_folder

        return ModelSource("trained", str(pipeline_folder(TRAINED_MODELS[model])), TRAINED_MODELS[model])
    if _looks_like_path(model):
        return ModelSource("folder", str(Path(model).expanduser()))
    if HUB_ID.fullmatch(model):
        return ModelSource("hub", model)
    raise ParadiffError(
        f"unknown model {model!r}; pass a local pipeline folder, a hub id (owner/name), "
        f"or one of {', '.join(MODEL_NAMES)}"
    )


def check_model(model: str) -> None:
    """Refuse a ``--model`` that cannot load, before any worker starts; one line that says why.

    A built-in name passes; a folder must hold ``model_index.json``; a hub id (owner/name) must have one
    on the hub or in the local cache (fetching that one small file, which also tells an offline machine
    or a missing repository apart from a real loading failure).
    """
    model_index(model)


def model_index(model: str) -> dict | None:
    """The ``model_index.json`` of ``model`` (None for the random-weight models), or a :class:`ParadiffError`."""
    source = model_source(model)
    if source.kind == "random":
        return None
    if source.kind == "trained":
        return _read_index(Path(source.location) / "model_index.json")
    if source.kind == "folder":
        folder = Path(source.location)
        if not folder.is_dir():
            raise ParadiffError(f"no pipeline folder {model}: {'it is a file' if folder.exists() else 'not found'}")
        index = folder / "model_index.json"
        if not index.is_file():
            raise ParadiffError(
                f"{model} holds no model_index.json: not a diffusers pipeline folder (save one with "
                "pipe.save_pretrained(folder))"
            )
        return _read_index(index)
    return _read_index(Path(_hub_model_index(model)))


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ParadiffError(f"cannot read {path}: {error}") from error
    if not isinstance(index, dict) or "_class_name" not in index:
        raise ParadiffError(f"{path} is not a diffusers model_index.json (it names no _class_name)")
    if not isinstance(index["_class_name"], str):
        raise ParadiffError(
            f"{path} names a custom pipeline class {index['_class_name']}; paradiff never runs code shipped "
            "with a model (trust_remote_code=False)"
        )
    return index


def _hub_model_index(repo_id: str) -> str:
    """The local path of ``repo_id``'s ``model_index.json`` (downloaded, or from the cache offline)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return hf_hub_download(repo_id, "model_index.json")
    except GatedRepoError as error:
        raise ParadiffError(
            f"hub model {repo_id} is gated: accept its terms on huggingface.co and log in (hf auth login)"
        ) from error
    except RepositoryNotFoundError as error:
        raise ParadiffError(
            f"no model {repo_id} on the Hugging Face hub (or it is private: log in with hf auth login)"
        ) from error
    except LocalEntryNotFoundError as error:  # before EntryNotFoundError, its base class
        if constants.HF_HUB_OFFLINE:
            raise ParadiffError(
                f"hub model {repo_id} is not in the local Hugging Face cache, and the hub is off "
                "(HF_HUB_OFFLINE is set); download it once online, or pass a local pipeline folder"
            ) from error
        raise ParadiffError(
            f"cannot reach the Hugging Face hub for {repo_id}, and it is not in the local cache; "
            "check the connection, or pass a local pipeline folder"
        ) from error
    except EntryNotFoundError as error:
        raise ParadiffError(f"hub model {repo_id} has no model_index.json: it is not a diffusers pipeline") from error
    except (OSError, ValueError) as error:
        raise ParadiffError(f"cannot fetch {repo_id} from the Hugging Face hub: {_first_line(error)}") from error


def load_pipeline(model: str, dtype=None, allow_pickle: bool = False):
    """The pipeline ``model`` names (see the module docstring), on the CPU, in ``dtype`` (default float32).

    Weights load from safetensors only unless ``allow_pickle``; code shipped with the model never runs.
    """
    source = model_source(model)
    if source.kind == "random":
        from .tiny import build_pipeline

        pipe = build_pipeline(source.builtin, size="bench")
        return pipe if dtype is None else pipe.to(dtype=dtype)
    model = source.location
    from diffusers import DiffusionPipeline

    options = {
        "use_safetensors": None if allow_pickle else True,  # None: safetensors where present, else pickle
        "trust_remote_code": False,
        "custom_pipeline": None,
        **absent_components(model),
    }
    try:
        with warnings.catch_warnings():
            # diffusers from 0.42 on calls it `dtype` and warns about `torch_dtype`, which every release takes
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            if dtype is not None:
                options["torch_dtype"] = dtype
            return DiffusionPipeline.from_pretrained(model, **options)
    except (OSError, ValueError) as error:
        raise ParadiffError(load_failure(model, error, allow_pickle)) from error


def load_failure(model: str, error: BaseException, allow_pickle: bool) -> str:
    """One line saying why ``model`` did not load: a weights file that is corrupt, pickled weights without
    ``allow_pickle``, code shipped with the model, or else the loader's own first line."""
    text = " ".join(" ".join(str(link).split()) for link in _chain(error))
    if "Weights only load failed" in text:  # torch's restricted unpickler, which diffusers loads pickles with
        return (
            f"model {model} has a pickled weights file holding Python objects besides tensors, which torch's safe "
            f"unpickler (weights_only=True) refuses to load ({_first_line(error)}); save the weights as safetensors"
        )
    damaged = corrupt_file(error)
    if damaged is not None:
        return corrupt_weights(damaged, error)
    if not allow_pickle and "safetensors" in text:
        return (
            f"model {model} has weights that are not safetensors ({_first_line(error)}); pickled weights "
            f"(.bin, .pt) can run code when loaded: pass {ALLOW_PICKLE_FLAG} (load_pipeline(..., "
            "allow_pickle=True)) only if you trust where they come from"
        )
    if "custom code" in text or "trust_remote_code" in text:
        return (
            f"model {model} needs code that ships with it ({_first_line(error)}); paradiff never runs code "
            "from a model (trust_remote_code=False): use a pipeline made of diffusers' own classes"
        )
    return (
        f"cannot load model {model!r} ({_first_line(error)}); pass a local pipeline folder, a hub id, "
        f"or one of {', '.join(MODEL_NAMES)}"
    )


#: A weights file named in a loader's error message.
_WEIGHTS_PATH = re.compile(r"""[^\s'"(]+\.(?:safetensors|bin|pt|pth|ckpt)""")


def corrupt_file(error: BaseException) -> Path | None:
    """The weights file an error says could not be read, when that file exists (so it is damaged, not missing)."""
    for link in _chain(error):
        for name in _WEIGHTS_PATH.findall(str(link)):
            if Path(name).is_file():
                return Path(name)
    return None


def corrupt_weights(path: Path, error: BaseException) -> str:
    """The message for a weights file that exists but cannot be read (truncated download, damaged disk)."""
    return (
        f"weights file {path} is corrupt or truncated ({_first_line(_chain(error)[-1])}); download the model again "
        "or save it again with save_pretrained"
    )


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from, outermost first."""
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        following = chain[-1].__cause__ or chain[-1].__context__
        if following in chain:
            break
        chain.append(following)
    return chain


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def default_size(model: str) -> int | None:
    """``generate``'s ``--size`` when none is given: the built-in models' own (``paradiff.builtin.DEFAULT_SIZE``);
    None (the pipeline's default) otherwise."""
    if model not in TRAINED_MODELS:
        return None
    from .builtin import DEFAULT_SIZE

    return DEFAULT_SIZE[TRAINED_MODELS[model]]


def default_steps(model: str) -> int:
    """The command line's ``--steps`` when none is given: a built-in model's own (``paradiff.builtin.OWN_STEPS``),
    else :data:`DEFAULT_STEPS`. A plan's printed commands leave ``--steps`` out at this value."""
    if model not in TRAINED_MODELS:
        return DEFAULT_STEPS
    from .builtin import OWN_STEPS

    return OWN_STEPS.get(TRAINED_MODELS[model], DEFAULT_STEPS)


def video_model(model: str) -> bool:
    """Whether ``model`` is known, before loading it, to make videos (the built-in video model)."""
    return TRAINED_MODELS.get(model) == "video"


def default_strategy(model: str) -> str:
    """``generate``'s ``--strategy`` when none is given: ``cfg`` for the built-in models (they run classifier-free
    guidance, and on two CPU ranks only the exact CFG split gains at their sizes), ``patch`` otherwise (a model
    may run no CFG)."""
    return "cfg" if model in TRAINED_MODELS else "patch"


#: Call arguments the command line sets itself, and the option that sets each.
SET_BY_OPTIONS = {
    "prompt": "the prompt",
    "height": "--size",
    "width": "--width",
    "num_inference_steps": "--steps",
    "generator": "--seed",
    "output_type": "the output file",
    "guidance_scale": "--guidance",
    "negative_prompt": "--negative-prompt",
    "num_frames": "--frames",
    "video_length": "--frames",
}


def size_kwargs(height: int | None, width: int | None) -> dict:
    """The call's ``height``/``width`` from ``--size`` and ``--width`` (default: the height); none given: none."""
    sizes = {"height": height, "width": width or height}
    return {name: value for name, value in sizes.items() if value is not None}


def call_arguments(items: list[str] | None) -> tuple[tuple[str, object], ...]:
    """``--call KEY=VALUE`` items as ``(key, value)`` pairs; VALUE is read as JSON (numbers, true, lists...) or else
    kept as a string."""
    pairs = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ParadiffError(f"--call takes KEY=VALUE, e.g. --call causal_block_size=5; got {item!r}")
        if key in SET_BY_OPTIONS:
            raise ParadiffError(f"--call {key}=...: {key} is set by {SET_BY_OPTIONS[key]}; use that instead")
        try:
            pairs[key] = json.loads(text)
        except ValueError:
            pairs[key] = text
    return tuple(pairs.items())


def prompt_kwargs(
    pipe,
    model: str,
    prompt: str,
    guidance: float | None = None,
    negative_prompt: str | None = None,
    extra: tuple[tuple[str, object], ...] = (),
) -> dict:
    """The keyword arguments that make ``pipe`` draw ``prompt``.

    ``guidance`` (``guidance_scale``) defaults to the built-in models' own (2) and to the pipeline's
    default otherwise; ``negative_prompt`` is passed only when given; ``extra`` (``--call``) adds arguments
    the pipeline's call takes.
    """
    source = model_source(model)
    if source.kind == "random":
        if negative_prompt is not None:
            raise ParadiffError(f"{model} has no text encoder, so it takes no negative prompt")
        from .tiny import prompt_inputs

        prompt_seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
        inputs = prompt_inputs(pipe, source.builtin, seed=prompt_seed)
    elif source.kind == "trained":
        from .builtin import call_kwargs

        inputs = call_kwargs(source.builtin, prompt)  # guidance 2, PixArt at the asked size, warns of words
    else:
        inputs = {"prompt": prompt}
    if guidance is not None:
        inputs["guidance_scale"] = guidance
    if negative_prompt is not None:
        if "negative_prompt" not in call_parameters(pipe):
            raise ParadiffError(f"{type(pipe).__name__} takes no negative prompt")
        inputs["negative_prompt"] = negative_prompt
    parameters = call_parameters(pipe)
    for key, value in extra:
        if key not in parameters:
            takes = ", ".join(sorted(parameters - {"self", *SET_BY_OPTIONS}))
            raise ParadiffError(f"--call {key}=...: {type(pipe).__name__} takes no argument {key!r}; it takes {takes}")
        _check_call_value(pipe, key, value)
        inputs[key] = value
    return inputs


def _check_call_value(pipe, key: str, value) -> None:
    """Refuse a ``--call`` value of another kind than the argument's default (a word where a number goes)."""
    default = inspect.signature(type(pipe).__call__).parameters[key].default
    if isinstance(default, bool):
        fits, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        kind = "an integer" if isinstance(default, int) else "a number"
        fits = fits and (isinstance(value, int) or not isinstance(default, int))
    else:
        return
    if not fits:
        raise ParadiffError(
            f"--call {key}={json.dumps(value)}: {type(pipe).__name__} takes {kind} for {key} "
            f"(its default is {json.dumps(default)})"
        )


#: The call arguments that draw several pictures of one prompt (image and video pipelines).
PER_PROMPT_ARGUMENTS = ("num_images_per_prompt", "num_videos_per_prompt")


def call_parameters(pipe) -> set[str]:
    """The keyword arguments ``pipe(...)`` takes."""
    return set(inspect.signature(type(pipe).__call__).parameters)


def frames_parameter(pipe) -> str | None:
    """The name under which ``pipe(...)`` takes a frame count (``num_frames``, Latte's ``video_length``), or None."""
    parameters = call_parameters(pipe)
    return next((name for name in ("num_frames", "video_length") if name in parameters), None)


def fixed_frames(pipe) -> int | None:
    """The one frame count ``pipe`` draws when its denoiser fixes it, else None.

    Latte's transformer adds a temporal position table of ``video_length`` rows to every clip, so it
    draws that many frames and no other count.
    """
    denoiser = getattr(pipe, "transformer", None)
    return getattr(getattr(denoiser, "config", None), "video_length", None)


def most_frames(pipe) -> int | None:
    """The most frames ``pipe`` draws when its denoiser bounds the count, else None.

    AnimateDiff's motion modules add a sinusoidal position table of ``motion_max_seq_length`` rows to each pixel's
    column of frames, so a longer clip fails inside the U-Net; any count up to it is drawn.
    """
    denoiser = getattr(pipe, "unet", None)
    return getattr(getattr(denoiser, "config", None), "motion_max_seq_length", None)


def frames_to_ask(frames: int, fixed: int | None, most: int | None) -> int | None:
    """The frame count to ask instead of ``frames`` where a denoiser draws ``fixed`` frames and no other count, or
    ``most`` at most (:func:`fixed_frames`, :func:`most_frames`); None when ``frames`` is drawn."""
    if fixed is not None:
        return None if frames == fixed else fixed
    return most if most is not None and frames > most else None


def frames_refusal(pipe, frames: int) -> str | None:
    """Why ``pipe`` cannot draw ``frames`` frames and the ``--frames`` that fixes it, or None when it can."""
    fixed = fixed_frames(pipe)
    ask = frames_to_ask(frames, fixed, most_frames(pipe))
    if ask is None:
        return None
    if fixed is not None:
        return f"draws {ask} frames (its transformer's video_length); use --frames {ask} or drop --frames"
    return f"draws at most {ask} frames (its motion modules' motion_max_seq_length); use --frames {ask} or fewer"


def default_height(pipe) -> int | None:
    """The height ``pipe(...)`` draws at when given none, where it can be told without running it.

    None when unknown, or when the pipeline bins the requested size to its own resolutions (PixArt's
    ``use_resolution_binning``): the strategy then checks the real height at the call.
    """
    parameters = inspect.signature(type(pipe).__call__).parameters
    height = parameters.get("height")
    if height is not None and isinstance(height.default, int):
        return height.default
    from .models import find_denoiser

    config = find_denoiser(pipe).config
    scale = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None)
    sample = getattr(pipe, "default_sample_size", None) or config.get("sample_height") or config.get("sample_size")
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    return sample * scale if isinstance(sample, int) and isinstance(scale, int) else None


def makes_video(pipe) -> bool:
    """Whether ``pipe`` returns frames rather than images: it takes a frame count, or is a video pipeline by name."""
    name = type(pipe).__name__
    return frames_parameter(pipe) is not None or "Video" in name or name.startswith(("AnimateDiff", "Wan"))


def absent_components(model: str) -> dict:
    """Components a local pipeline folder saved as absent (``[null, null]``): passed as None to load."""
    index = Path(model) / "model_index.json"
    if not index.is_file():
        return {}
    entries = json.loads(index.read_text())
    return {name: None for name, value in entries.items() if isinstance(value, list) and value[0] is None}


def warn_if_cut(pipe, prompt: str, inputs: dict) -> None:
    """Warn when the text encoder reads only the start of ``prompt`` (the pipeline cuts the rest silently).

    The limit is what the pipeline tokenizes to: its ``max_sequence_length`` argument where it takes one,
    else the tokenizer's own length, and never more than the text encoder's position table.
    """
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None or not isinstance(prompt, str):
        return
    limit = tokenizer.model_max_length
    parameter = inspect.signature(type(pipe).__call__).parameters.get("max_sequence_length")
    if parameter is not None and isinstance(inputs.get("max_sequence_length", parameter.default), int):
        limit = inputs.get("max_sequence_length", parameter.default)
    positions = getattr(getattr(getattr(pipe, "text_encoder", None), "config", None), "max_position_embeddings", None)
    if isinstance(positions, int):
        limit = min(limit, positions)
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) <= limit:
        return
    cut = tokenizer.decode(ids[limit - 1 :], skip_special_tokens=True).strip()
    cut = cut if len(cut) <= 60 else cut[:57] + "..."
    warnings.warn(
        f"the prompt is {len(ids)} tokens long and {type(pipe).__name__} reads the first {limit}: "
        f"the end is cut ({cut!r}); shorten the prompt",
        ParadiffWarning,
        stacklevel=2,
    )
