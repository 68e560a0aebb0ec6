"""Well-known denoisers by name, for plans without weights: their public configs, built on the meta device.

Each ``architectures/<name>.json`` holds the denoiser's class, its config as published, the dtype it runs
in, and the shapes of one denoiser call as its pipeline makes it. A shape's entries are numbers or
expressions in ``H`` and ``W`` (latent rows and columns: pixels over ``vae_scale_factor``), ``F`` (latent
frames, from ``frames`` by ``latent_frames``) and ``frames``; an input may be ``{"shape": [...], "dtype":
"int64"}`` or ``null``. An optional ``vae`` holds the VAE's class, config, the dtype its pipeline decodes
in and the latent it decodes, for the decode's cost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ParadiffError

FOLDER = Path(__file__).with_name("architectures")
_EXPRESSION = re.compile(r"^[HWF0-9+\-*/() ]+$|^[a-z0-9+\-*/() ]+$")


def architecture_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in FOLDER.glob("*.json")))


@dataclass(frozen=True)
class Architecture:
    name: str
    spec: dict

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.spec["dtype"])

    @property
    def hub_id(self) -> str:
        """The Hugging Face repository its config comes from (what ``paradiff generate --model`` loads)."""
        return self.spec["source"].split(",")[0].strip()

    @property
    def default_size(self) -> int:
        return self.spec["default_size"]

    @property
    def default_frames(self) -> int | None:
        return self.spec.get("default_frames")

    @property
    def calls_per_step(self) -> int:
        return self.spec.get("calls_per_step", 1)

    def model_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.spec["class"])

    def dims(self, size: int, frames: int | None, width: int | None = None) -> dict:
        """Latent rows ``H``, columns ``W`` and frames ``F`` of a ``size`` × ``width`` (default: square) call."""
        scale = self.spec["vae_scale_factor"]
        width = width or size
        for name, pixels in (("size", size), ("width", width)):
            if pixels % scale:
                raise ParadiffError(f"{name} {pixels} is not a multiple of {scale} pixels for {self.name}")
        dims = {"H": size // scale, "W": width // scale, "F": 1}
        if self.default_frames is not None:
            frames = frames or self.default_frames
            dims["F"] = _evaluate(self.spec["latent_frames"], {"frames": frames})
        elif frames is not None:
            raise ParadiffError(f"{self.name} makes images; drop --frames")
        return dims

    def inputs(self, dims: dict) -> dict:
        """The denoiser call's keyword arguments, as empty tensors on the meta device."""
        return {name: _tensor(value, dims, self.dtype) for name, value in self.spec["inputs"].items()}

    def token_rows(self, dims: dict) -> int:
        return _evaluate(self.spec["token_rows"], dims)

    def decode_cost(self, dims: dict) -> tuple[float, int, str] | None:
        """``(FLOPs, kernel-launching operations, dtype name)`` of the VAE decode of one image; None without a VAE."""
        import diffusers
        import torch

        from .workload import decode_cost, meta_model

        vae = self.spec.get("vae")
        if vae is None:
            return None
        dtype = getattr(torch, vae["dtype"])
        model = meta_model(getattr(diffusers, vae["class"]), vae["config"], dtype)
        flops, kernels = decode_cost(model, _tensor(vae["latent"], dims, dtype))
        return flops, kernels, vae["dtype"]


def architecture(name: str) -> Architecture:
    path = FOLDER / f"{name}.json"
    if not path.is_file():
        raise ParadiffError(f"unknown architecture {name!r}; known: {', '.join(architecture_names())}")
    return Architecture(name, json.loads(path.read_text()))


def _evaluate(expression, dims: dict) -> int:
    if isinstance(expression, int):
        return expression
    if not _EXPRESSION.match(expression):
        raise ValueError(f"not a shape expression: {expression!r}")
    return int(eval(expression, {"__builtins__": {}}, dims))  # digits, operators and the dimension names only


def _tensor(value, dims: dict, dtype):
    import torch

    if value is None:
        return None
    if isinstance(value, dict) and "shape" not in value:
        return {key: _tensor(item, dims, dtype) for key, item in value.items()}
    if isinstance(value, dict):
        dtype, value = getattr(torch, value["dtype"]), value["shape"]
    return torch.empty([_evaluate(entry, dims) for entry in value], dtype=dtype, device="meta")
