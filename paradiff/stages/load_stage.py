"""Loading a pipeline with only this rank's stage of its transformer blocks, for ``pipefusion`` and ``dualparal``.

``from_pretrained`` (diffusers') gives every rank the whole denoiser before ``parallelize`` frees the other
stages: for a 12B transformer that is 24 GB per rank at load time, on ranks that keep a quarter of it.
:func:`load_stage_pipeline` never holds it: the denoiser is built from its config on the meta device
(accelerate's ``init_empty_weights``), its blocks are cut into stages of about equal parameter bytes (what
each rank then holds) unless ``pipefusion_stages`` says otherwise, and this rank reads from the safetensors
files only the tensors of its own stage and of the layers every rank keeps (embeddings, head), each
straight onto its device (accelerate's ``set_module_tensor_to_device``). The other stages' parameters stay
on the meta device (shapes, no memory) until ``parallelize(pipe, strategy="pipefusion")`` frees them for
good; the other components load as diffusers loads them. ``dualparal`` cuts its frame-block stack the same
way (stages of about equal parameters), so a pipeline loaded for it runs it on the same ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ParadiffError
from ..loading import absent_components, corrupt_weights, load_failure, model_index, model_source
from ..models import family_of
from ..runtime.distributed import env_world_size, local_device
from .blocks import stage_blocks
from .cut import cut_by_bytes

#: Where the record of a stage-loaded denoiser lives on the module.
LOADED_STAGE_ATTRIBUTE = "_paradiff_loaded_stage"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class LoadedStage:
    """What :func:`load_stage_pipeline` loaded into a denoiser."""

    #: Blocks of each stage, in block order, and the stage this rank holds.
    stages: tuple[int, ...]
    stage: int
    #: Whether the stages run within each half of a CFG split (a 2 × stages mesh).
    cfg_parallel: bool
    #: Names of the parameters and buffers every rank holds (everything outside the blocks).
    shared: tuple[str, ...]
    #: The strategy the stages are for.
    strategy: str = "pipefusion"


def loaded_stage(denoiser: nn.Module) -> LoadedStage | None:
    return getattr(denoiser, LOADED_STAGE_ATTRIBUTE, None)


def loaded_cut(denoiser: nn.Module, rank: int) -> tuple[int, ...] | None:
    """The cut ``denoiser`` was loaded by stage with (None: loaded whole); refuses a rank that loaded another stage."""
    held = loaded_stage(denoiser)
    if held is None:
        return None
    if held.stage != rank:
        raise ParadiffError(
            f"this rank loaded stage {held.stage} of the blocks but is stage {rank} of the pipeline; load "
            "with the rank parallelize runs on (load_stage_pipeline's default)"
        )
    return held.stages


def check_loaded_stage(denoiser: nn.Module, config, world_size: int) -> None:
    """Refuse, before any collective, to parallelize a denoiser loaded by stage other than as it was loaded."""
    held = loaded_stage(denoiser)
    if held is None:
        return
    halves = 2 if held.cfg_parallel else 1
    loaded_as = (
        f"strategy='{held.strategy}'{', cfg_parallel=True' if held.cfg_parallel else ''} on "
        f"{len(held.stages) * halves} ranks"
    )
    given = config.options.pipefusion_stages if config.strategy == "pipefusion" else None
    if (
        config.strategy != held.strategy
        or config.cfg_parallel != held.cfg_parallel
        or world_size != len(held.stages) * halves
        or given not in (None, held.stages)
    ):
        raise ParadiffError(
            f"this pipeline's {type(denoiser).__name__} holds only stage {held.stage} of its blocks "
            f"(stages {list(held.stages)}, loaded by stage): it runs only with {loaded_as}; load the whole "
            "pipeline with from_pretrained for anything else"
        )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _pipeline_folder(model: str) -> Path:
    model_index(model)  # a model that cannot load fails here, with the loader's own message
    source = model_source(model)
    if source.kind in ("trained", "folder"):
        return Path(source.location)
    from diffusers import DiffusionPipeline

    return Path(DiffusionPipeline.download(model, use_safetensors=True))


def _weight_files(folder: Path) -> list[Path]:
    """The denoiser's safetensors files: one, or the shards its index names."""
    index = folder / f"{WEIGHTS_NAME}.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    raise ParadiffError(
        f"{folder} holds no {WEIGHTS_NAME} (or its sharded index): loading one stage reads safetensors only"
    )


def _meta_denoiser(folder: Path, name: str, class_name: str) -> nn.Module:
    import diffusers
    from accelerate import init_empty_weights

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise ParadiffError(f"component {name} is a {class_name}, which is not a diffusers model class")
    with init_empty_weights():
        return cls.from_config(cls.load_config(folder / name))


def _stage_cut(blocks: list[nn.Module], degree: int, stages: tuple[int, ...] | None) -> tuple[int, ...]:

    if stages is None:
        return cut_by_bytes(blocks, degree)
    if len(stages) != degree or sum(stages) != len(blocks) or min(stages) < 1:
        raise ParadiffError(
            f"pipefusion_stages={list(stages)} does not cut this model's {len(blocks)} blocks into {degree} stages "
            f"(one per rank); give {degree} block counts >= 1 that add up to {len(blocks)}"
        )
    return tuple(stages)


#: The strategies that keep one stage of the blocks per rank.
STAGED = ("pipefusion", "dualparal")


def load_stage_pipeline(
    model: str,
    *,
    strategy: str = "pipefusion",
    cfg_parallel: bool = False,
    pipefusion_stages: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
):
    """The pipeline ``model`` names (a folder, a hub id, a built-in name), its denoiser holding only this rank's
    stage of blocks, on ``device`` (default: this rank's GPU, else the CPU), ready for
    ``paradiff.parallelize(pipe, strategy=strategy, cfg_parallel=cfg_parallel)`` on ``world_size`` ranks
    (default: the current world); ``strategy`` is ``"pipefusion"`` or ``"dualparal"``.

    Do not move the pipeline before ``parallelize``: the other stages' parameters are on the meta device.
    """
    from diffusers import DiffusionPipeline
    from safetensors import SafetensorError, safe_open

    if strategy not in STAGED:
        raise ParadiffError(f"loading by stage is for strategy='pipefusion' or 'dualparal', not {strategy!r}")
    if pipefusion_stages is not None and strategy != "pipefusion":
        raise ParadiffError(f"pipefusion_stages is an option of strategy='pipefusion'; drop it for {strategy!r}")
    world_size = env_world_size() if world_size is None else world_size
    rank = _rank() if rank is None else rank
    groups = 2 if cfg_parallel else 1
    if world_size % groups or world_size // groups < 2:
        raise ParadiffError(
            f"loading by stage needs at least 2 pipeline stages, and {world_size} ranks"
            f"{' split into 2 CFG halves' if cfg_parallel else ''} give {world_size // groups}; load the whole "
            "pipeline with from_pretrained instead"
        )
    degree, device = world_size // groups, torch.device(device) if device is not None else local_device()
    folder = _pipeline_folder(model)
    index = json.loads((folder / "model_index.json").read_text())
    name = "transformer"
    if not isinstance(index.get(name), list) or index[name][0] is None:
        raise ParadiffError(
            f"{model} has no transformer component: strategy='{strategy}' cuts a transformer's blocks into stages"
        )
    denoiser = _meta_denoiser(folder, name, index[name][1])
    stack = _stack(family_of(denoiser), strategy)
    if stack is None:
        raise ParadiffError(f"{type(denoiser).__name__} has no block stack that strategy='{strategy}' can cut")
    blocks = [block for _, block in stage_blocks(denoiser, stack)]
    cut = _stage_cut(blocks, degree, pipefusion_stages)
    stage = rank % degree
    first = sum(cut[:stage])
    others = blocks[:first] + blocks[first + cut[stage] :]
    held = _held_tensors(denoiser, others)
    shared = _held_tensors(denoiser, blocks)
    loaded = set()
    for path in _weight_files(folder / name):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as weights:
                for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key in held:
                        _put(denoiser, key, weights.get_tensor(key), device, dtype)
                        loaded.add(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise ParadiffError(corrupt_weights(path, error)) from error
    missing = sorted(held - loaded - _unsaved_buffers(denoiser))
    if missing:
        raise ParadiffError(f"{folder / name} lacks {len(missing)} of this stage's tensors, e.g. {missing[0]}")
    for key, buffer in denoiser.named_buffers():
        if key not in loaded and buffer.device.type != "meta":
            _put(denoiser, key, buffer, device, None)
    setattr(denoiser, LOADED_STAGE_ATTRIBUTE, LoadedStage(cut, stage, cfg_parallel, tuple(sorted(shared)), strategy))
    options = {"use_safetensors": True, "trust_remote_code": False, "custom_pipeline": None}
    options.update(absent_components(str(folder)), **{name: denoiser})
    if dtype is not None:
        options["torch_dtype"] = dtype
    try:
        pipe = DiffusionPipeline.from_pretrained(str(folder), **options)
    except (OSError, ValueError) as error:
        raise ParadiffError(load_failure(model, error, allow_pickle=False)) from error
    for component in pipe.components.values():
        if isinstance(component, nn.Module) and component is not denoiser:
            component.to(device)
    return pipe


def _stack(family, strategy: str):
    """The blocks ``strategy`` cuts into stages on ``family``'s models, or None."""
    if strategy == "pipefusion":
        return family.block_stack

    blocks = family.frame_blocks
    return None if blocks is None else blocks.stack


def _held_tensors(denoiser: nn.Module, others: list[nn.Module]) -> set[str]:
    """Names of the parameters and buffers outside the modules of ``others``."""
    elsewhere = {id(m) for block in others for m in block.modules()}
    names = set()
    for module_name, module in denoiser.named_modules():
        if id(module) not in elsewhere:
            for tensor_name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                names.add(f"{module_name}.{tensor_name}" if module_name else tensor_name)
    return names


def _unsaved_buffers(denoiser: nn.Module) -> set[str]:
    """Buffers a checkpoint does not hold (non-persistent: computed at construction)."""
    names = set()
    for module_name, module in denoiser.named_modules():
        for buffer_name in module._non_persistent_buffers_set:
            names.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return names


def _put(denoiser: nn.Module, key: str, tensor: torch.Tensor, device: torch.device, dtype) -> None:
    from accelerate.utils import set_module_tensor_to_device

    target = dtype if dtype is not None and tensor.is_floating_point() else None
    set_module_tensor_to_device(denoiser, key, device, value=tensor, dtype=target)
