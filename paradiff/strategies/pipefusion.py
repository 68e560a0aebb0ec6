"""Displaced patch pipeline parallelism (PipeFusion): each rank holds one stage of the DiT's blocks.

The blocks (Flux: the double-stream then the single-stream ones, as one sequence) are cut into N
contiguous stages of about equal measured cost (``stage_cut``), or as ``pipefusion_stages`` says.
Rank ``s`` keeps only stage ``s``'s block parameters; the embeddings and the head stay on every rank.
Warm-up calls pass the whole sequence through the stages in turn (exact); later calls pass M patches
of whole token rows, which keeps every stage busy once the pipeline is full, with each attention layer
attending to a buffer of the whole image's K/V, one step stale outside the patches already done
(``paradiff.layers.stages``). The family (``paradiff.models``) says where the blocks are and what
they pass on; this module knows no model class.

The pipeline drains at the end of every call: the pipeline's own ``__call__`` (CFG combine, scheduler
step, callbacks) runs between two denoiser calls, and no patch of the next step exists before it has
run on the whole latent. Each call therefore leaves each rank idle for about N−1 of M+N−1 patch slots,
measured per call as ``idle_share`` in ``paradiff.comm_stats``.

Memory: the other stages' parameters are freed, not copied anywhere (each keeps its ``Parameter``
object, holding an empty tensor). ``unparallelize`` restores them exactly by broadcasting each
stage's parameters from the rank that kept them, so it is a collective: call it on every rank, as
``parallelize``. Restoring moves (N−1)/N of the blocks' parameters to every rank once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from torch import nn

from ..config import ParallelConfig
from ..errors import ParadiffError
from ..layers.attention import plan_kv_completion
from ..layers.stages import (
    PassThroughHook,
    PatchKV,
    PipelineCall,
    PipelineCallHook,
    Stage,
    StageEntryHook,
    plan_patches,
    stage_blocks,
)
from ..models import FAMILIES, DenoiserFamily, family_of
from ..runtime.comm import Communicator
from .patch import invalidate_hook_cache
from .stage_cut import balanced_cut, measured_costs

HOOK_NAME = "paradiff.pipefusion"


@dataclass
class InstalledPipeFusion:
    """What :class:`PipeFusionStrategy` changed on one denoiser, so that it can be undone exactly."""

    denoiser: nn.Module
    comm: Communicator
    #: Every block, in the order the forward runs them, and how many of them each stage holds.
    blocks: list[nn.Module]
    cut: tuple[int, ...]
    hooked: list[nn.Module] = field(default_factory=list)
    processors: list[tuple[nn.Module, object]] = field(default_factory=list)
    #: Shapes of the parameters freed on this rank (the other stages'), by ``id`` of the parameter.
    released: dict[int, torch.Size] = field(default_factory=dict)

    def remove(self) -> None:
        for module in self.hooked:
            module._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
        for attn, processor in self.processors:
            attn.set_processor(processor)
        self._restore()
        invalidate_hook_cache(self.denoiser)

    def _restore(self) -> None:
        """Every rank takes part in one broadcast per parameter of every stage, from the rank that kept it."""
        ranks = self.comm.ranks
        for stage, blocks in enumerate(_split(self.blocks, self.cut)):
            for param in _params_of(blocks):
                if id(param) in self.released:
                    param.data = param.data.new_empty(self.released.pop(id(param)))
                dist.broadcast(param.data, ranks.global_rank(stage), group=ranks.group)


class PipeFusionStrategy:
    name = "pipefusion"
    #: Displaced after warm-up: ``warmup_steps`` trades speed for fidelity.
    uses_warmup = True

    def __init__(self, patches: int | None = None, stages: tuple[int, ...] | None = None):
        self.patches, self.stages = patches, stages

    @classmethod
    def create(cls, config, groups) -> PipeFusionStrategy:
        return cls(patches=config.pipefusion_patches, stages=config.pipefusion_stages)

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config: ParallelConfig) -> None:
        """Refuse, before any collective, a model whose blocks cannot form ``degree`` stages."""
        name = type(denoiser).__name__
        if family.block_stack is None:
            supported = ", ".join(n for f in FAMILIES if f.block_stack is not None for n in f.class_names)
            raise ParadiffError(
                f"strategy='pipefusion' does not support {name}: it cuts a transformer's sequence of blocks into "
                f"stages; supported: {supported} (use strategy='patch' or 'cfg' for the others)"
            )
        count = len(stage_blocks(denoiser, family.block_stack))
        if count < degree:
            raise ParadiffError(
                f"strategy='pipefusion' gives each of its {degree} stages (one per rank) at least one block, but "
                f"this {name} has {count} transformer blocks; run it on at most {count} ranks (per CFG half with "
                "cfg_parallel), or use strategy='patch'"
            )
        # every attention layer, not only a rank's own stage's: all ranks refuse the same processor alike
        plan_kv_completion(family, family.self_attention(denoiser), lambda name: (None, None), cls.name)
        stages = config.pipefusion_stages
        if stages is not None and sum(stages) != count:
            raise ParadiffError(
                f"pipefusion_stages={list(stages)} cuts {sum(stages)} blocks, but this {name} has {count} transformer "
                "blocks; give block counts that add up to it"
            )

    def check_height(self, denoiser: nn.Module, comm: Communicator, height: int, vae_scale_factor: int) -> None:
        """Fail before any work when ``height`` pixels cannot be cut into the patches of whole rows."""
        pixels = family_of(denoiser).pixels_per_row(denoiser, vae_scale_factor)
        if height % pixels:
            raise ParadiffError(f"height {height} is not a multiple of {pixels} pixels per row of tokens")
        plan_patches(height // pixels, self.patches, comm.size, pixels)

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> InstalledPipeFusion:
        """Keep this rank's stage of ``denoiser``'s blocks, free the others', hook it to run as a pipeline."""
        stack = family.block_stack
        named = stage_blocks(denoiser, stack)
        blocks = [block for _, block in named]
        cut = self.stages or balanced_cut(measured_costs(family, denoiser, blocks, comm), comm.size)
        first = sum(cut[: comm.rank])
        mine = range(first, first + cut[comm.rank])
        installed = InstalledPipeFusion(denoiser, comm, blocks, cut)

        def hook(module: nn.Module, hook) -> None:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
            installed.hooked.append(module)

        def kv_pair(name: str) -> tuple[PatchKV, PatchKV]:
            return PatchKV(comm, f"{HOOK_NAME}.{name}.k"), PatchKV(comm, f"{HOOK_NAME}.{name}.v")

        own_modules = {id(m) for i in mine for m in blocks[i].modules()}
        layers = [(name, attn) for name, attn in family.self_attention(denoiser) if id(attn) in own_modules]
        kv_hooks, processors = plan_kv_completion(family, layers, kv_pair, self.name)

        call = PipelineCall(comm)
        hook(denoiser, PipelineCallHook(family, call, self.patches, vae_scale_factor))
        block_hooks = {i: PassThroughHook(stack) for i in range(len(blocks)) if i != first}

        def stage_forwards() -> list:  # the blocks' own forwards, beneath the hooks registered below
            return [block_hooks[i].fn_ref.original_forward for i in mine]

        block_hooks[first] = StageEntryHook(Stage(stack, call, stage_forwards))
        for index, block in enumerate(blocks):
            hook(block, block_hooks[index])
        for module, layer_hook in kv_hooks:
            hook(module, layer_hook)
        for attn, processor in processors:
            installed.processors.append((attn, attn.processor))
            attn.set_processor(processor)
        installed.released = _release(denoiser, blocks, cut, comm.rank)
        invalidate_hook_cache(denoiser)
        return installed


def _split(blocks: list[nn.Module], cut: tuple[int, ...]) -> list[list[nn.Module]]:
    bounds = [0, *itertools.accumulate(cut)]
    return [blocks[start:stop] for start, stop in itertools.pairwise(bounds)]


def _params_of(blocks: list[nn.Module]) -> list[nn.Parameter]:
    """The blocks' parameters, each once, in a fixed order."""
    seen, params = set(), []
    for block in blocks:
        for param in block.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _release(denoiser: nn.Module, blocks: list[nn.Module], cut: tuple[int, ...], stage: int) -> dict[int, torch.Size]:
    """Free the parameters of the other stages' blocks (those no kept module shares); their shapes by ``id``."""
    others = [block for s, group in enumerate(_split(blocks, cut)) if s != stage for block in group]
    elsewhere = {id(m) for block in others for m in block.modules()}
    kept = {id(p) for m in denoiser.modules() if id(m) not in elsewhere for p in m.parameters(recurse=False)}
    released = {}
    for param in _params_of(others):
        if id(param) not in kept:
            released[id(param)] = param.shape
            param.data = param.data.new_empty(0)
    return released
