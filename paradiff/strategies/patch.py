"""Displaced patch parallelism (DistriFusion), with an optional partial context (PCPP).

Every rank holds the whole model and computes one row band of the image at every layer. Layers that
mix rows get what they need from the other bands: this step's during warm-up (exact), last step's
afterwards, exchanged in the background. The family (``paradiff.models``) says where the bands are
cut and joined and which attention layers mix image tokens; this module knows no model class.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from diffusers.hooks import HookRegistry
from torch import nn

from ..config import ParallelConfig
from ..errors import ParadiffError
from ..layers.attention import DisplacedKV, plan_kv_completion
from ..layers.group_norm import BandGroupNormHook
from ..layers.halo_conv import HaloConv2dHook, check_halo_conv, needs_halo
from ..layers.split import BandSplitHook, TokenGatherHook, TokenSliceHook, band_rows_error
from ..models import DenoiserFamily, family_of
from ..runtime.comm import Communicator

HOOK_NAME = "paradiff.patch"


@dataclass
class InstalledPatch:
    """What :class:`PatchStrategy` changed on one denoiser, so that it can be undone exactly."""

    denoiser: nn.Module
    hooked: list[nn.Module] = field(default_factory=list)
    processors: list[tuple[nn.Module, object]] = field(default_factory=list)

    def remove(self) -> None:
        for module in self.hooked:
            module._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
        for attn, processor in self.processors:
            attn.set_processor(processor)
        invalidate_hook_cache(self.denoiser)


class PatchStrategy:
    name = "patch"
    #: Displaced after warm-up: ``warmup_steps`` trades speed for fidelity.
    uses_warmup = True

    def __init__(self, partial_context: float | None = None):
        self.partial_context = partial_context

    @classmethod
    def create(cls, config, groups) -> PatchStrategy:
        return cls(partial_context=config.partial_context)

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config: ParallelConfig) -> None:
        """Nothing more to refuse: every family paradiff knows runs in row bands; sizes are checked per call."""

    def check_height(self, denoiser: nn.Module, comm: Communicator, height: int, vae_scale_factor: int) -> None:
        """Fail before any work when ``height`` pixels cannot be cut into aligned bands."""
        family = family_of(denoiser)
        pixels = family.pixels_per_row(denoiser, vae_scale_factor)
        rows = height // pixels
        error = band_rows_error(rows, family, denoiser, comm.size, vae_scale_factor)
        if error or height % pixels:
            raise ParadiffError(error or f"height {height} is not a multiple of {pixels} pixels per row")

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> InstalledPatch:
        """Hook ``denoiser`` (or a VAE decoder: any module ``family`` describes) to run in row bands."""
        installed = InstalledPatch(denoiser)
        tags = itertools.count(1)

        def hook(module: nn.Module, hook) -> None:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
            installed.hooked.append(module)

        plan = []
        if family.banded_spatial_layers:
            for name, module in denoiser.named_modules():
                if isinstance(module, nn.Conv2d) and needs_halo(module):
                    check_halo_conv(name, module)
                    plan.append((module, HaloConv2dHook(comm, name, next(tags))))
                elif isinstance(module, nn.GroupNorm):
                    plan.append((module, BandGroupNormHook(comm, name)))

        def kv_pair(name: str) -> tuple[DisplacedKV, DisplacedKV]:
            return tuple(DisplacedKV(comm, f"{name}.{p}", next(tags), self.partial_context) for p in "kv")

        kv_hooks, processors = plan_kv_completion(family, family.self_attention(denoiser), kv_pair, self.name)
        plan += kv_hooks

        hook(denoiser, BandSplitHook(family, comm, vae_scale_factor))
        if family.token_module:
            hook(denoiser.get_submodule(family.token_module), TokenSliceHook(comm))
        if family.output_module:
            hook(denoiser.get_submodule(family.output_module), TokenGatherHook(comm))
        for module, layer_hook in plan:
            hook(module, layer_hook)
        for attn, processor in processors:
            installed.processors.append((attn, attn.processor))
            attn.set_processor(processor)
        invalidate_hook_cache(denoiser)
        return installed


def invalidate_hook_cache(module: nn.Module) -> None:
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()
