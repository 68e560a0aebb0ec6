"""Exact sequence parallelism (``ulysses``, ``ring``) through diffusers' own context parallelism.

Every rank holds the whole model and 1/D of the token sequence. In each attention layer diffusers
either swaps tokens for heads with all-to-alls (Ulysses: every rank attends over the whole sequence
with H/D heads) or passes the keys and values around the ring, merging partial attentions by their
log-sum-exp (ring). Exact at every step, so ``warmup_steps`` changes nothing. paradiff only sets it
up: ``ContextParallelConfig`` and ``model.enable_parallelism(config=..., cp_plan=...)``, with the plan
and, where the stock processor bypasses diffusers' attention dispatcher, a processor that does not
(both declared per family in ``paradiff.models``; this module knows no model class).

Running it on CPU ranks (gloo). diffusers builds its mesh for an accelerator: ``enable_parallelism``
asks ``ModelMixin._resolve_parallel_config`` to compute the device as ``rank %
torch.accelerator.device_count()`` (a ZeroDivisionError without an accelerator) and, unless the
config carries a mesh, to call ``init_device_mesh`` for the accelerator type with fresh groups.
paradiff instead

* builds the ``DeviceMesh`` itself over its own groups, for the device type it computes on ("cpu"
  or "cuda"): ``runtime.mesh.context_parallel_mesh``, so diffusers' collectives carry paradiff's
  timeout and a CFG split is one more mesh dimension;
* sets the config up through diffusers' own ``ParallelConfig.setup(rank, world_size, device,
  mesh=...)`` with that device and mesh;
* for the duration of the ``enable_parallelism`` call only, shadows ``_resolve_parallel_config`` on
  this model instance (an instance attribute, removed right after) so that it records that config
  instead of computing a device. The rest of ``enable_parallelism`` (the backend check, handing
  the config to the processors, registering the plan's hooks) is diffusers' own, on CPU and GPU alike.

The one group diffusers still creates (the flattened ring × ulysses group it gathers the output on)
is the default group without a CFG split; with one, it is a new group with torch's default timeout.

Attention backends: diffusers runs context parallelism only in backends registered for it.
``native`` (PyTorch SDPA, the default) is the one that runs on CPU, and it serves Ulysses. Ring
needs each partial attention's log-sum-exp, which ``native`` cannot return; the backends that can
(``_native_cudnn``, ``_native_flash``, ``flash``, ``sage``) all need CUDA, so ring is refused on CPU.
paradiff never changes the backend (``set_attention_backend`` also changes diffusers' process-wide
default): errors say which one to set.

``unparallelize`` undoes it completely with diffusers' ``remove_context_parallel`` (the plan's
hooks), the original processors, and by dropping the config from the model and its processors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from diffusers import ContextParallelConfig
from diffusers import ParallelConfig as DiffusersParallelConfig
from diffusers.hooks import HookRegistry
from diffusers.hooks.context_parallel import remove_context_parallel
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from torch import nn

from ..config import ParallelConfig
from ..errors import ParadiffError
from ..layers.sequence import AttentionTrafficHook, SequenceCheckHook
from ..models import FAMILIES, DenoiserFamily
from ..runtime.comm import Communicator
from ..runtime.distributed import local_device
from ..runtime.mesh import MeshGroups, context_parallel_mesh

HOOK_NAME = "paradiff.sequence"


@dataclass
class InstalledSequence:
    """What :class:`SequenceStrategy` changed on one denoiser, so that it can be undone exactly."""

    denoiser: nn.Module
    plan: dict
    config: DiffusersParallelConfig
    processors: list[tuple[nn.Module, object]] = field(default_factory=list)
    hooked: list[nn.Module] = field(default_factory=list)

    def hook(self, module: nn.Module, hook) -> None:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        self.hooked.append(module)

    def remove(self) -> None:
        denoiser = self.denoiser
        for module in self.hooked:
            module._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
        remove_context_parallel(denoiser, self.plan)
        for attn, processor in self.processors:
            attn.set_processor(processor)
        for module in denoiser.modules():
            processor = getattr(module, "processor", None)
            if getattr(processor, "_parallel_config", None) is self.config:
                del processor._parallel_config  # back to the class's None
        del denoiser._parallel_config
        HookRegistry.check_if_exists_or_initialize(denoiser).invalidate_child_registries_cache()


class SequenceStrategy:
    """Runs diffusers' context parallelism over the strategy's D ranks (within each CFG half)."""

    name = ""
    #: The ``ContextParallelConfig`` dimension the D ranks form: "ulysses" or "ring".
    sequence_dim = ""
    #: Exact at every step: ``warmup_steps`` changes nothing.
    uses_warmup = False

    def __init__(self, groups: MeshGroups):
        self.groups = groups

    @classmethod
    def create(cls, config, groups: MeshGroups) -> SequenceStrategy:
        return cls(groups)

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config: ParallelConfig) -> None:
        """Refuse, before any collective, a model this strategy cannot run over ``degree`` ranks."""
        name = type(denoiser).__name__
        if not family.context_parallel:
            supported = ", ".join(n for f in FAMILIES if f.context_parallel for n in f.class_names)
            raise ParadiffError(
                f"strategy='{cls.name}' does not support {name}; supported: {supported} "
                "(use strategy='patch' or 'cfg' for the others)"
            )
        if getattr(denoiser, "_parallel_config", None) is not None:
            raise ParadiffError(f"this {name} already runs diffusers' own parallelism (enable_parallelism)")
        if family.context_parallel_plan(denoiser) is None:
            raise ParadiffError(f"this diffusers version has no context-parallel plan (_cp_plan) for {name}")
        family.context_parallel_processors(denoiser)  # raises for a processor that cannot run
        cls.check_backend(_attention_backend(denoiser))

    @classmethod
    def check_backend(cls, backend: str) -> None:
        if not _AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(backend)):
            supported = ", ".join(sorted(_AttentionBackendRegistry._supports_context_parallel))
            raise ParadiffError(
                f"attention backend '{backend}' has no context-parallel support in diffusers; call "
                f"pipe.transformer.set_attention_backend(name) with one of: {supported} ('native' runs everywhere)"
            )

    def check_height(self, denoiser: nn.Module, comm: Communicator, height: int, vae_scale_factor: int) -> None:
        """Nothing to check on the height alone: the denoiser's hook checks each call's whole token grid."""

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> InstalledSequence:
        """Enable diffusers' context parallelism on ``denoiser`` over ``comm``'s ranks."""
        device = local_device()
        mesh = context_parallel_mesh(self.groups, self.sequence_dim, device.type)
        cp_config = ContextParallelConfig(**{f"{self.sequence_dim}_degree": comm.size}, mesh=mesh)
        config = DiffusersParallelConfig(context_parallel_config=cp_config)
        config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
        plan = family.context_parallel_plan(denoiser)
        installed = InstalledSequence(denoiser, plan, config)
        for attn, processor in family.context_parallel_processors(denoiser):
            installed.processors.append((attn, attn.processor))
            attn.set_processor(processor)

        def resolved(_config) -> DiffusersParallelConfig:
            denoiser._parallel_config = config
            return config

        denoiser._resolve_parallel_config = resolved  # this instance, this call only (module docstring)
        try:
            denoiser.enable_parallelism(config=config, cp_plan=plan)
        finally:
            del denoiser._resolve_parallel_config
        for _, attn in family.self_attention(denoiser):
            installed.hook(attn, AttentionTrafficHook(comm, self.sequence_dim))
        installed.hook(denoiser, SequenceCheckHook(self.name, family, comm, vae_scale_factor))  # outside the plan's
        HookRegistry.check_if_exists_or_initialize(denoiser).invalidate_child_registries_cache()
        return installed


class UlyssesStrategy(SequenceStrategy):
    name = "ulysses"
    sequence_dim = "ulysses"

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config: ParallelConfig) -> None:
        super().check_model(denoiser, family, degree, config)
        heads = denoiser.config.num_attention_heads
        if heads % degree:
            fits = " or ".join(str(n) for n in range(2, heads + 1) if heads % n == 0)
            fix = f"run it on {fits} ranks (per CFG half with cfg_parallel), or " if fits else ""
            raise ParadiffError(
                f"strategy='ulysses' gives each of the {degree} ranks whole attention heads, but "
                f"{type(denoiser).__name__} has {heads} heads, which is not divisible by {degree}; "
                f"{fix}use strategy='ring'"
            )


class RingStrategy(SequenceStrategy):
    name = "ring"
    sequence_dim = "ring"

    @classmethod
    def check_backend(cls, backend: str) -> None:
        if local_device().type == "cpu":
            raise ParadiffError(
                "strategy='ring' does not run on CPU: ring attention merges partial attentions by their "
                "log-sum-exp, and diffusers' only context-parallel attention backend on CPU ('native') cannot "
                "return it; use strategy='ulysses' on CPU"
            )
        super().check_backend(backend)
        if backend == AttentionBackendName.NATIVE.value:
            raise ParadiffError(
                "strategy='ring' needs an attention backend that returns the log-sum-exp, and diffusers' "
                "'native' cannot; call pipe.transformer.set_attention_backend('_native_cudnn') (fp16/bf16), "
                "'flash' or 'sage' first, or use strategy='ulysses'"
            )


def _attention_backend(denoiser: nn.Module) -> str:
    """The backend diffusers' context parallelism will use: a processor's own, else the process default."""
    for module in denoiser.modules():
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        if backend is not None:
            return AttentionBackendName(backend).value
    return _AttentionBackendRegistry.get_active_backend()[0].value
