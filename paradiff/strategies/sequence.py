"""Exact sequence parallelism (``ulysses``, ``ring``) through diffusers' own context parallelism.

Every rank holds the whole model and 1/D of the token sequence. In each attention layer diffusers
either swaps tokens for heads with all-to-alls (Ulysses: every rank attends over the whole sequence
with H/D heads) or passes the keys and values around the ring, merging partial attentions by their
log-sum-exp (ring). Exact at every step, so ``warmup_steps`` changes nothing. paradiff only sets it
up: ``ContextParallelConfig`` and ``model.enable_parallelism(config=..., cp_plan=...)``, with the plan
and, where the stock processor bypasses diffusers' attention dispatcher, a processor that does not, or
a hook that hands the stock processor's own attention call to the dispatcher
(``paradiff.layers.sdpa_dispatch``); the family in ``paradiff.models`` declares which (this module
knows no model class).

Running it on CPU ranks (gloo). diffusers builds its mesh for an accelerator: from diffusers 0.41 on,
``enable_parallelism`` computes the device as ``rank % torch.accelerator.device_count()`` (a
ZeroDivisionError without an accelerator) and, unless the config carries a mesh, calls
``init_device_mesh`` for the accelerator type with fresh groups. paradiff instead

* builds the ``DeviceMesh`` itself over its own groups, for the device type it computes on ("cpu"
  or "cuda"): ``runtime.mesh.context_parallel_mesh``, so diffusers' collectives carry paradiff's
  timeout and a CFG split is one more mesh dimension;
* sets the config up through diffusers' own ``ParallelConfig.setup(rank, world_size, device,
  mesh=...)`` with that device and mesh;
* for the duration of the ``enable_parallelism`` call only, makes this model instance take that
  config as it is instead of resolving one (``paradiff.compat.recording_parallel_config``). The rest
  of ``enable_parallelism`` (the backend check, handing the config to the processors, registering
  the plan's hooks) is diffusers' own, on CPU and GPU alike.

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

from typing import ClassVar

import torch.distributed as dist
from diffusers import ContextParallelConfig
from diffusers import ParallelConfig as DiffusersParallelConfig
from diffusers.hooks.context_parallel import remove_context_parallel
from diffusers.models.attention_dispatch import AttentionBackendName
from torch import nn

from ..compat import (
    active_attention_backend,
    clear_parallel_config,
    context_parallel_backend_available,
    context_parallel_backends,
    derived_context_parallel_meshes,
    parallel_config_of,
    recording_parallel_config,
)
from ..errors import ParadiffError
from ..layers.sdpa_dispatch import DispatchedSDPAHook
from ..layers.sequence import AttentionTrafficHook, SequenceCheckHook
from ..models import DenoiserFamily
from ..runtime.comm import Communicator
from ..runtime.distributed import local_device
from ..runtime.mesh import context_parallel_mesh
from .base import Strategy
from .costing import CostMachine, CostSetting, StepCost
from .installation import Installation
from .support import strategies_for, supported_classes


class SequenceStrategy(Strategy):
    """Runs diffusers' context parallelism over the strategy's D ranks (within each CFG half)."""

    #: The ``ContextParallelConfig`` dimension the D ranks form: "ulysses" or "ring".
    sequence_dim = ""
    uses_warmup = False
    call_split = "tokens"

    #: Whether the keys and values travel around a ring (``ring``) rather than in all-to-alls (``ulysses``).
    ring_exchange: ClassVar[bool] = False

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """The patch's compute, exact every step, nothing overlapped: Ulysses's four all-to-alls per attention
        layer move 2·(N−1)/N² of its keys and values; the ring passes 1/N of them N−1 times; the prediction's
        bands are gathered."""
        w = m.w
        compute = m.compute(w.flops / m.groups / n)
        kv = w.kv_bytes / m.groups
        nbytes = kv * (n - 1) / n if cls.ring_exchange else 2 * kv * (n - 1) / n**2
        nbytes += w.latent_bytes / m.groups * (n - 1) / n
        exchanges = w.attention_layers * ((n - 1) if cls.ring_exchange else 4) + 1
        step = compute + m.transfer(nbytes, m.calls * exchanges)
        return StepCost(step, step, nbytes, nbytes, m.weights)

    @classmethod
    def supports(cls, family: DenoiserFamily) -> bool:
        return family.context_parallel

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        """Refuse, before any collective, a model this strategy cannot run over ``degree`` ranks."""
        name = type(denoiser).__name__
        if not cls.supports(family):
            raise ParadiffError(
                f"strategy='{cls.name}' does not support {name}; supported: {supported_classes(cls)} "
                f"({strategies_for(family)} run {name})"
            )
        if parallel_config_of(denoiser) is not None:
            raise ParadiffError(f"this {name} already runs diffusers' own parallelism (enable_parallelism)")
        if family.context_parallel_plan(denoiser) is None:
            raise ParadiffError(f"this diffusers version ships no context-parallel plan for {name}")
        family.context_parallel_processors(denoiser)  # raises for a processor that cannot run

    @classmethod
    def check_machine(cls, denoiser: nn.Module) -> None:
        cls.check_backend(active_attention_backend(denoiser))

    @classmethod
    def check_backend(cls, backend: str) -> None:
        if not context_parallel_backend_available(backend):
            raise ParadiffError(
                f"attention backend '{backend}' has no context-parallel support in diffusers; call "
                f"pipe.transformer.set_attention_backend(name) with one of: {', '.join(context_parallel_backends())} "
                "('native' runs everywhere)"
            )

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> Installation:
        """Enable diffusers' context parallelism on ``denoiser`` over ``comm``'s ranks."""
        device = local_device()
        mesh = context_parallel_mesh(self.groups, self.sequence_dim, device.type)
        cp_config = ContextParallelConfig(**{f"{self.sequence_dim}_degree": comm.size}, mesh=mesh)
        config = DiffusersParallelConfig(context_parallel_config=cp_config)
        config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
        plan = family.context_parallel_plan(denoiser)
        installed = Installation(denoiser, self.name)
        for attn, processor in family.context_parallel_processors(denoiser):
            installed.set_processor(attn, processor)
        with recording_parallel_config(denoiser, config):  # this instance, this call only (module docstring)
            denoiser.enable_parallelism(config=config, cp_plan=plan)
        installed.on_remove(lambda: clear_parallel_config(denoiser, config))
        installed.on_remove(lambda: remove_context_parallel(denoiser, plan))
        self.groups.adopt([mesh, *derived_context_parallel_meshes(cp_config)])  # shut down by unparallelize
        backend = active_attention_backend(denoiser)
        for name, attn in family.self_attention(denoiser):
            if family.context_parallel_sdpa:  # a processor that calls PyTorch's attention: into diffusers' dispatcher
                installed.hook(attn, DispatchedSDPAHook(name, config, backend, comm, self.sequence_dim))
            else:
                installed.hook(attn, AttentionTrafficHook(comm, self.sequence_dim))
        installed.hook(denoiser, SequenceCheckHook(self.name, family, comm, vae_scale_factor))  # outside the plan's
        return installed.done()


class UlyssesStrategy(SequenceStrategy):
    name = "ulysses"
    sequence_dim = "ulysses"

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        super().check_model(denoiser, family, degree, config)
        heads = denoiser.config.num_attention_heads
        if heads % degree:
            fits = " or ".join(str(n) for n in range(2, heads + 1) if heads % n == 0)
            fix = f"run it on {fits} ranks (per CFG half with cfg_parallel), or " if fits else ""
            raise ParadiffError(
                f"strategy='ulysses' gives each of the {degree} ranks whole attention heads, but "
                f"{type(denoiser).__name__} has {heads} heads, which is not divisible by {degree}; "
                f"{fix}use strategy='ring' (or {strategies_for(family)} on {degree} ranks)"
            )


class RingStrategy(SequenceStrategy):
    name = "ring"
    sequence_dim = "ring"
    ring_exchange = True

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
