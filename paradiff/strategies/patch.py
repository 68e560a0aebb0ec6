"""Displaced patch parallelism (DistriFusion), with an optional partial context (PCPP).

Every rank holds the whole model and computes one row band of the image at every layer. Layers that
mix rows get what they need from the other bands: this step's during warm-up (exact), last step's
afterwards, exchanged in the background. The family (``paradiff.models``) says where the bands are
cut and joined and which attention layers mix image tokens; this module knows no model class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ParadiffError
from ..layers.attention import DisplacedKV, plan_kv_completion
from ..layers.group_norm import BandGroupNormHook
from ..layers.halo_conv import HaloConv2dHook, check_halo_conv, needs_halo
from ..layers.sdpa_kv import JointText, SDPACompletionHook
from ..layers.split import BandSplitHook, TokenGatherHook, TokenSliceHook, band_rows_error
from ..layers.token_plan import plan_hooks
from ..models import Capability, DenoiserFamily, family_of
from ..runtime.comm import BUCKET_LIMIT_BYTES, Communicator
from .base import Strategy, StrategyOptions, is_count
from .costing import CostMachine, CostSetting, StepCost
from .installation import Installation

#: The dtypes displaced K/V may be kept in (``stale_dtype``).
STALE_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class PatchOptions(StrategyOptions):
    """
    Attributes:
        partial_context: PCPP. ``None`` (default): after warm-up every band attends to the whole image. A
            fraction ``p`` in [0, 1]: after warm-up a band attends to itself plus the ``p`` of each neighbouring
            band nearest the border, received from its two neighbours only; ``0`` means its own band alone.
        bucket_limit_bytes: on displaced steps, a layer's piece smaller than this is packed with the other small
            pieces into one transfer per denoiser call (few launches); larger pieces are sent on their own as soon
            as they exist (a whole step to arrive behind the compute).
        stale_dtype: ``"bfloat16"`` or ``"float16"``: on displaced steps the other bands' keys and values travel
            and are kept in this dtype where it is narrower than the model's (half the memory and bytes of
            an fp32 model's buffers); warm-up steps stay exact. ``None`` (default): the model's dtype.
    """

    partial_context: float | None = None
    bucket_limit_bytes: int = BUCKET_LIMIT_BYTES
    stale_dtype: str | None = None

    def __post_init__(self):
        context = self.partial_context
        fraction = isinstance(context, (int, float)) and not isinstance(context, bool) and 0 <= context <= 1
        if context is not None and not fraction:
            raise ParadiffError(f"partial_context must be None or within [0, 1], got {self.partial_context!r}")
        if not is_count(self.bucket_limit_bytes, 0):
            raise ParadiffError(f"bucket_limit_bytes must be an integer >= 0, got {self.bucket_limit_bytes!r}")
        if self.stale_dtype is not None and self.stale_dtype not in STALE_DTYPES:
            raise ParadiffError(
                f"stale_dtype must be None or one of {', '.join(map(repr, STALE_DTYPES))}, got {self.stale_dtype!r}"
            )

    @property
    def stale_torch_dtype(self) -> torch.dtype | None:
        return None if self.stale_dtype is None else getattr(torch, self.stale_dtype)


class PatchStrategy(Strategy):
    name = "patch"
    refreshes = "per call"
    call_split = "tokens"
    Options = PatchOptions
    needs = (Capability.TOKEN_PLAN, Capability.ROW_BANDS)

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """1/N of every layer's tokens; the keys and values of every image attention layer gathered from the
        other bands ((N−1)/N of them), a halo row above and below each 3×3 convolution, a statistics exchange
        per GroupNorm, and the bands of the prediction gathered. A narrower ``stale_dtype`` shrinks the displaced
        steps' keys and values, sent and kept."""
        w, groups = m.w, m.groups
        stale = setting.options.get("stale_dtype")
        narrowing = min(1.0, getattr(torch, stale).itemsize / w.itemsize) if stale else 1.0
        compute = m.compute(w.flops / groups / n)
        transfers = m.calls * (w.attention_layers + w.convolutions + w.group_norms + 1)
        others = (2 * w.halo_row_bytes + w.latent_bytes) / groups * (n - 1) / n
        nbytes = w.kv_bytes / groups * (n - 1) / n + others
        displaced_bytes = w.kv_bytes * narrowing / groups * (n - 1) / n + others
        transfer = m.transfer(displaced_bytes, transfers)
        memory = m.weights + w.kv_bytes * narrowing / groups
        return StepCost(
            compute + m.transfer(nbytes, transfers), m.displaced(compute, transfer), nbytes, displaced_bytes, memory
        )

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        """Refuse, before any collective, a family it cannot cut, or PCPP on tokens not cut into row bands."""
        super().check_model(denoiser, family, degree, config)
        if family.split_by_plan and config.options.partial_context is not None:
            raise ParadiffError(
                f"partial_context needs the image's row bands, and the {family.name} model's tokens are cut into "
                "contiguous pieces of its whole sequence; leave partial_context unset"
            )

    def check_height(self, denoiser: nn.Module, degree: int, height: int, vae_scale_factor: int) -> None:
        """Fail before any work when ``height`` pixels cannot be cut into aligned bands."""
        family = family_of(denoiser)
        pixels = family.pixels_per_row(denoiser, vae_scale_factor)
        rows = height // pixels
        error = band_rows_error(rows, family, denoiser, degree, vae_scale_factor)
        if error or height % pixels:
            raise ParadiffError(error or f"height {height} is not a multiple of {pixels} pixels per row")

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> Installation:
        """Hook ``denoiser`` (or a VAE decoder: any module ``family`` describes) to run in row bands."""
        installed = Installation(denoiser, self.name)
        comm.bucket_limit_bytes = self.options.bucket_limit_bytes
        partial_context, stale_dtype = self.options.partial_context, self.options.stale_torch_dtype
        if family.split_by_plan:
            return self.install_by_plan(installed, denoiser, family, comm)
        plan = []
        if family.banded_spatial_layers:
            for name, module in denoiser.named_modules():
                if isinstance(module, nn.Conv2d) and needs_halo(module):
                    check_halo_conv(name, module)
                    plan.append((module, HaloConv2dHook(comm, name, comm.tags(1, lasting=True)[0])))
                elif isinstance(module, nn.GroupNorm):
                    plan.append((module, BandGroupNormHook(comm, name)))

        def kv_pair(name: str) -> tuple[DisplacedKV, DisplacedKV]:
            return tuple(
                DisplacedKV(comm, f"{name}.{p}", comm.tags(1, lasting=True)[0], partial_context, stale_dtype)
                for p in "kv"
            )

        kv_hooks, processors = plan_kv_completion(family, family.self_attention(denoiser), kv_pair, self.name)
        plan += kv_hooks

        installed.hook(denoiser, BandSplitHook(family, comm, vae_scale_factor))
        if family.token_module:
            installed.hook(denoiser.get_submodule(family.token_module), TokenSliceHook(comm))
        if family.output_module:
            installed.hook(denoiser.get_submodule(family.output_module), TokenGatherHook(comm))
        for module, layer_hook in plan:
            installed.hook(module, layer_hook)
        for attn, processor in processors:
            installed.set_processor(attn, processor)
        return installed.done()

    def install_by_plan(
        self, installed: Installation, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator
    ) -> Installation:
        """Cut the token sequences where the family's plan says; complete K/V where attention is computed."""

        def kv_pair(name: str) -> tuple[DisplacedKV, DisplacedKV]:
            return tuple(DisplacedKV(comm, f"{name}.{p}", None, None, self.options.stale_torch_dtype) for p in "kv")

        text = JointText(first=family.joint_text_first)
        for module, hook in plan_hooks(denoiser, family, family.split_plan(denoiser), comm, text):
            installed.hook(module, hook)
        for name, attn in family.self_attention(denoiser):
            installed.hook(attn, SDPACompletionHook(name, self.name, kv_pair, text))
        return installed.done()
