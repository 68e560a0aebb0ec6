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

import diffusers
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
    ulysses_pads_heads,
)
from ..errors import ParadiffError
from ..layers.heads import padded_heads
from ..layers.sdpa_dispatch import DispatchedSDPAHook
from ..layers.sequence_hooks import AttentionTrafficHook, SequenceCheckHook
from ..models import Capability, DenoiserFamily
from ..runtime.comm import Communicator
from ..runtime.distributed import local_device
from ..runtime.mesh import context_parallel_mesh
from .base import Strategy
from .costing import CostMachine, CostSetting, StepCost
from .installation import Installation
from .support import strategies_for


class SequenceStrategy(Strategy):
    """Runs diffusers' context parallelism over the strategy's D ranks (within each CFG half)."""

    #: The ``ContextParallelConfig`` dimension the D ranks form: "ulysses" or "ring".
    sequence_dim = ""
    uses_warmup = False
    needs = (Capability.CONTEXT_PARALLEL,)
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
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        """Refuse, before any collective, a model this strategy cannot run over ``degree`` ranks."""
        super().check_model(denoiser, family, degree, config)
        name = type(denoiser).__name__
        if parallel_config_of(denoiser) is not None:
            raise ParadiffError(f"this {name} already runs diffusers' own parallelism (enable_parallelism)")
        if family.context_parallel_plan(denoiser) is None:
            raise ParadiffError(f"this diffusers version ships no context-parallel plan for {name}")
        family.context_parallel_processors(denoiser)  # raises for a processor that cannot run

    @classmethod
    def check_machine(cls, denoiser: nn.Module) -> None:
        cls.check_backend(active_attention_backend(denoiser))

    def context_parallel_options(self, denoiser: nn.Module, family: DenoiserFamily, degree: int) -> dict:
        """Options of diffusers' ``ContextParallelConfig`` besides the degree and the mesh (none by default)."""
        return {}

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
        degree = {f"{self.sequence_dim}_degree": comm.size}
        cp_config = ContextParallelConfig(
            **degree, mesh=mesh, **self.context_parallel_options(denoiser, family, comm.size)
        )
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
    """Any head count: where the ranks do not divide it, zero heads pad it, by paradiff where it makes the
    attention call (``paradiff.layers.heads``), else by diffusers' ``ulysses_anything`` (0.42 on)."""

    name = "ulysses"
    sequence_dim = "ulysses"

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """As every sequence strategy's, with each rank attending with ⌈H/N⌉ heads and exchanging them: a head count
        N does not divide costs the padded heads' attention and bytes too."""
        even = super().step_cost(m, n, setting)
        w = m.w
        heads = w.attention_heads
        if not heads or heads % n == 0:
            return even
        padding = padded_heads(heads, n) / heads - 1  # the share of attention the zero heads add
        extra_s = m.compute(w.attention_flops / m.groups / n * padding, calls=0)
        extra_bytes = 2 * w.kv_bytes / m.groups * (n - 1) / n**2 * padding
        step = even.sync_s + extra_s + m.transfer(extra_bytes, 0)
        nbytes = even.sync_bytes + extra_bytes
        return StepCost(step, step, nbytes, nbytes, even.memory_bytes)

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        super().check_model(denoiser, family, degree, config)
        if family.context_parallel_sdpa:  # paradiff makes the attention call: it pads any count
            return
        for heads in sorted(_head_counts(denoiser, family)):
            if heads % degree == 0:
                continue
            name = type(denoiser).__name__
            fits = " or ".join(str(n) for n in range(2, heads + 1) if heads % n == 0)
            others = f"run it on {fits} ranks (per CFG half with cfg_parallel), or use " if fits else "use "
            others += f"{strategies_for(family)} on {degree} ranks"
            if not ulysses_pads_heads():
                raise ParadiffError(
                    f"strategy='ulysses' gives each of the {degree} ranks whole attention heads, and {name} has "
                    f"{heads}, which diffusers {diffusers.__version__} cannot split unevenly (0.42 pads them); "
                    f"upgrade diffusers, or {others}"
                )
            per_rank = padded_heads(heads, degree) // degree
            if padded_heads(heads, degree) - heads >= per_rank:  # diffusers pads the last rank's heads only
                raise ParadiffError(
                    f"strategy='ulysses' gives each of the {degree} ranks {per_rank} of {name}'s {heads} attention "
                    f"heads, which would leave the last rank none of its own (diffusers pads only that rank's); "
                    f"{others}"
                )

    def context_parallel_options(self, denoiser: nn.Module, family: DenoiserFamily, degree: int) -> dict:
        """diffusers' uneven mode where its processors attend with heads the ranks do not divide."""
        uneven = any(heads % degree for heads in _head_counts(denoiser, family))
        return {"ulysses_anything": True} if uneven and not family.context_parallel_sdpa else {}


def _head_counts(denoiser: nn.Module, family: DenoiserFamily) -> set[int]:
    """The head counts of the model's self-attention layers (its config's where a layer does not say)."""
    counts = {getattr(attn, "heads", None) for _, attn in family.self_attention(denoiser)}
    counts.discard(None)
    return counts or {denoiser.config.num_attention_heads}


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
