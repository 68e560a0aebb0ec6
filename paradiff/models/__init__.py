"""Denoiser families paradiff knows, looked up by the denoiser's class."""

from __future__ import annotations

import inspect

from torch import nn

from ..errors import ParadiffError
from .allegro import AllegroFamily
from .auraflow import AuraFlowFamily
from .base import Capability, DenoiserFamily, Grid
from .chroma import ChromaFamily
from .cogvideox import CogVideoXFamily
from .cogview4 import CogView4Family
from .dit import PixArtFamily, SD3Family
from .flux import FluxFamily
from .hunyuan_video import HunyuanVideoFamily
from .hunyuandit import HunyuanDiTFamily
from .latte import LatteFamily
from .ltx import LTXFamily
from .lumina2 import Lumina2Family
from .mochi import MochiFamily
from .planned import PlannedDiTFamily
from .qwenimage import QwenImageFamily
from .sana import SanaFamily
from .skyreels_v2 import SkyReelsV2Family
from .unet import UNetFamily
from .vae import VAEDecoderFamily
from .video_unet import AnimateDiffFamily, StableVideoDiffusionFamily
from .wan import WanFamily

#: The attributes a diffusers pipeline keeps its denoiser under.
DENOISER_ATTRIBUTES = ("transformer", "unet")

FAMILIES: tuple[DenoiserFamily, ...] = (
    # U-Nets: image, then video
    UNetFamily(),
    AnimateDiffFamily(),
    StableVideoDiffusionFamily(),
    # image DiTs
    PixArtFamily(),
    SD3Family(),
    FluxFamily(),
    ChromaFamily(),
    SanaFamily(),
    HunyuanDiTFamily(),
    AuraFlowFamily(),
    CogView4Family(),
    Lumina2Family(),
    QwenImageFamily(),
    # video DiTs
    WanFamily(),
    CogVideoXFamily(),
    HunyuanVideoFamily(),
    LTXFamily(),
    MochiFamily(),
    AllegroFamily(),
    LatteFamily(),
    SkyReelsV2Family(),
)
DECODER_FAMILIES: tuple[DenoiserFamily, ...] = (VAEDecoderFamily(),)

__all__ = [
    "DECODER_FAMILIES",
    "FAMILIES",
    "AnyDenoiserFamily",
    "Capability",
    "DenoiserFamily",
    "Grid",
    "PlannedDiTFamily",
    "decoder_family_of",
    "families",
    "family_of",
    "register_family",
    "unregister_family",
]

#: Families registered from outside paradiff (:func:`register_family`), tried before the built-in ones.
_REGISTERED: list[DenoiserFamily] = []


def register_family(family: DenoiserFamily) -> None:
    """Describe more denoiser classes: ``family`` (a :class:`DenoiserFamily` instance) is tried before the built-in
    families, so it may also describe a subclass of a class they cover. Register it on every rank."""
    if not isinstance(family, DenoiserFamily) or not family.name or not family.class_names:
        raise ParadiffError("register_family takes a DenoiserFamily instance with a name and class_names")
    if any(known.name == family.name for known in families()):
        raise ParadiffError(f"a denoiser family named {family.name!r} exists; give yours another name")
    _REGISTERED.insert(0, family)


def unregister_family(name: str) -> None:
    """Forget a family :func:`register_family` added (the built-in ones stay)."""
    kept = [family for family in _REGISTERED if family.name != name]
    if len(kept) == len(_REGISTERED):
        raise ParadiffError(f"no registered denoiser family is named {name!r}; built-in families cannot be removed")
    _REGISTERED[:] = kept


def families() -> tuple[DenoiserFamily, ...]:
    """Every family paradiff knows, in the order they are tried: the registered ones, then the built-in ones."""
    return (*_REGISTERED, *FAMILIES)


def decoder_family_of(model: nn.Module) -> DenoiserFamily | None:
    """The family of a VAE decoder paradiff can band, or None (then every rank decodes it whole)."""
    return next((family for family in DECODER_FAMILIES if family.matches(model)), None)


class AnyDenoiserFamily(DenoiserFamily):
    """A denoiser class paradiff knows nothing about: enough for strategies that never look inside it.

    What they need is read from the class's ``forward``: the latent is its first argument (diffusers'
    denoisers all take it first, as ``hidden_states`` or ``sample``), the timestep is ``timestep``.
    """

    name = "any"
    described = False

    def __init__(self, model: nn.Module | None = None):
        if model is not None:
            parameters = list(inspect.signature(type(model).forward).parameters)[1:]
            self.latent_arg = parameters[0]
            self.timestep_arg = "timestep" if "timestep" in parameters else None


def family_of(model: nn.Module, any_model: bool = False) -> DenoiserFamily:
    """The family of ``model``; with ``any_model``, :class:`AnyDenoiserFamily` for a class paradiff does not know."""
    for family in families():
        if family.matches(model):
            return family
    if PlannedDiTFamily.describes(model):
        return PlannedDiTFamily(model)
    if any_model:
        return AnyDenoiserFamily(model)
    supported = ", ".join(name for family in families() for name in family.class_names)
    raise ParadiffError(
        f"denoiser class {type(model).__name__} is not supported; supported classes: {supported} "
        "(strategy='parastep' and strategy='cfg' run any denoiser, also together: parastep with cfg_parallel=True)"
    )


def find_denoiser(pipe) -> nn.Module:
    """The pipeline's denoiser (its transformer or U-Net), or a ParadiffError naming what it lacks."""
    for attribute in DENOISER_ATTRIBUTES:
        module = getattr(pipe, attribute, None)
        if isinstance(module, nn.Module):
            return module
    raise ParadiffError(
        f"{type(pipe).__name__} has no denoiser attribute ({' or '.join(DENOISER_ATTRIBUTES)}); "
        "paradiff parallelizes diffusers pipelines built around a U-Net or a transformer"
    )
