"""Displaced patch pipeline parallelism (PipeFusion): each rank holds one stage of the DiT's blocks.

The blocks (Flux: the double-stream then the single-stream ones, as one sequence) are cut into N
contiguous stages of about equal measured cost (``stage_cut``), or as ``pipefusion_stages`` says.
Rank ``s`` keeps only stage ``s``'s block parameters; the embeddings and the head stay on every rank.
Warm-up calls pass the whole sequence through the stages (exact), each sample of the call's batch on its own
(the samples of a batch never meet, so stage 1 works on sample 0 while stage 0 starts sample 1: with CFG's
two samples, 2 ranks finish a warm-up call in 3 half-calls' time, not 4), or with ``pipefusion_sync="sequence"``
run every block on each rank's band of token rows, which costs 1/N of the compute but keeps every block on every
rank (the bands' K/V gathered layer by layer also fill the stage's buffers); later calls pass M patches
of whole token rows, which keeps every stage busy once the pipeline is full, with each attention layer
attending to a buffer of the whole image's K/V, one step stale outside the patches already done
(``paradiff.stages.blocks``). The family (``paradiff.models``) says where the blocks are and what
they pass on; this module knows no model class.

After warm-up the pipeline flows from one denoiser call into the next instead of draining at the end
of each (``paradiff.stages.flow``): stage 0 starts patch p of the next call as soon as the last stage has
finished patch p of this one, so each rank idles only while the pipeline first fills. The pipeline's own
loop (CFG combine, scheduler step, callbacks) still runs between the calls, on every rank, and nothing of
it is forked or re-implemented: its work is per position in every stock pipeline, so the next call's
input at a finished patch's rows is worked out ahead (``paradiff.stages.next_call``: a copy of the
scheduler, the pipeline's guidance and input forms, each learned bit for bit from what the pipeline does
at its first steps), and every rank checks what it computed ahead against the call the pipeline then
makes. Each stage runs its patches in the same order as when the pipeline drains, so each layer's buffer
holds the same mix of fresh and stale patches: flowing computes what draining computes, bit for bit.
A call that differs (a callback that edits latents, a loop the forecast does not reproduce) is undone
and drains, and so do the later ones; ``comm_stats(pipe)["flow"]`` says so. ``pipefusion_flow=False``
drains every call; so does a pipeline whose CFG halves are split over ranks (``cfg_parallel``). Each call
measures the share of it each rank spent idle, ``idle_share`` in ``paradiff.comm_stats``.

Memory: the other stages' parameters are freed, not copied anywhere (each keeps its ``Parameter``
object, holding an empty tensor). ``unparallelize`` restores them exactly by broadcasting each
stage's parameters from the rank that kept them, so it is a collective: call it on every rank, as
``parallelize``. Restoring moves (N−1)/N of the blocks' parameters to every rank once. A pipeline loaded with
:func:`paradiff.load_stage_pipeline` never held the other stages: their parameters wait on the meta device
and ``parallelize`` frees them the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ParadiffError
from ..layers.attention import plan_kv_completion
from ..layers.prompt_projection import PromptProjectionHook, prompt_projections
from ..layers.sdpa_kv import SDPACompletionHook
from ..models import Capability, DenoiserFamily, family_of
from ..runtime.comm import Communicator
from ..stages.blocks import (
    CFG_HALVES_DRAIN,
    PassThroughHook,
    PatchKV,
    PatchText,
    PipelineCall,
    PipelineCallHook,
    Stage,
    StageEntryHook,
    check_row_bands,
    plan_patches,
    stage_blocks,
)
from ..stages.cut import balanced_cut, measured_costs
from ..stages.load_stage import LOADED_STAGE_ATTRIBUTE, loaded_cut, loaded_stage
from ..stages.next_call import NextCall
from ..stages.release import check_releasable, params_of, release_other_stages, stage_groups
from .base import Strategy, StrategyOptions, is_count, is_counts
from .costing import CostMachine, CostSetting, StepCost, balanced_sums
from .installation import Installation

#: How exact calls run (``pipefusion_sync``): through the stages, or in row bands on every rank.
SYNC_MODES = ("stages", "sequence")


@dataclass(frozen=True)
class PipeFusionOptions(StrategyOptions):
    """
    Attributes:
        pipefusion_patches: number M of patches (bands of whole token rows) that flow through the pipeline of stages
            on displaced steps, at least the number of stages. ``None`` (default): the divisor of the call's token
            rows nearest to twice the stages (measured best on CPU: fewer patches leave more of each step idle while
            the pipeline fills and drains, more patches make each stage's matrix products too small to run
            efficiently).
        pipefusion_stages: number of transformer blocks of each stage, in block order (one entry per rank of the
            pipeline); ``None`` (default): contiguous stages of about equal measured cost.
        pipefusion_flow: after warm-up, start the next denoiser call's first patches while the last stage finishes
            this call's (True, default: each rank idles only while the pipeline first fills), or drain the pipeline
            at the end of every call (False). Both compute the same result.
        pipefusion_sync: how exact calls (warm-up, refreshes) run. ``"stages"`` (default): each sample of the call
            passes whole through the stages, and each rank keeps only its stage's block weights. ``"sequence"``:
            every rank keeps every block and runs the exact call on its band of token rows, gathering each
            attention layer's keys and values of this step from the other bands, N times less compute per rank
            than one device for the weights of the whole model on every rank. Both compute the same result.
    """

    pipefusion_patches: int | None = None
    pipefusion_stages: tuple[int, ...] | None = None
    pipefusion_flow: bool = True
    pipefusion_sync: str = "stages"

    def __post_init__(self):
        if not isinstance(self.pipefusion_flow, bool):
            raise ParadiffError(f"pipefusion_flow must be True or False, got {self.pipefusion_flow!r}")
        if self.pipefusion_sync not in SYNC_MODES:
            raise ParadiffError(
                f"pipefusion_sync must be one of {', '.join(map(repr, SYNC_MODES))}, got {self.pipefusion_sync!r}"
            )
        patches, stages = self.pipefusion_patches, self.pipefusion_stages
        if patches is not None and not is_count(patches, 1):
            raise ParadiffError(f"pipefusion_patches must be None or an integer >= 1, got {patches!r}")
        if stages is not None:
            if not is_counts(stages, 1):
                raise ParadiffError(
                    f"pipefusion_stages must be None or the number of blocks of each stage (integers >= 1), "
                    f"got {stages!r}"
                )
            object.__setattr__(self, "pipefusion_stages", tuple(stages))


class PipeFusionStrategy(Strategy):
    name = "pipefusion"
    refreshes = "per call"
    call_split = "pieces"
    Options = PipeFusionOptions
    needs = (Capability.BLOCK_CHAIN,)
    follows_model_changes = False

    #: Draining at every call, and exact calls in row bands (also under the CFG split, where every call drains
    #: anyway), are predicted beside the defaults.
    plan_variants = (((("pipefusion_flow", False),), 2), ((("pipefusion_sync", "sequence"),), 2, True))

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """1/N of the blocks per rank over M patches per call; the embeddings and head on every rank; each stage
        passes its patch's hidden states on. Draining, each call runs M + N − 1 patch slots; flowing, M, plus one
        forward around the blocks per patch worked out ahead on the first and the last stage, a vote per call
        and the next latents sent from the last stage to the first, and the N − 1 slots of filling the pipeline
        once; under the CFG split each call drains (its next latent needs both halves). Exact steps pass each
        sample of a call whole (``_sync_step``), or with ``pipefusion_sync="sequence"`` run 1/N of the tokens on
        every rank and gather every attention layer's keys and values and the bands (``_sequence_step``), every
        rank then holding every block. Without ``pipefusion_patches`` the plan chooses the M (a divisor of the
        token rows, at least N) whose loop is fastest."""
        flows = setting.options.get("pipefusion_flow", True) and m.groups == 1
        sequence = setting.options.get("pipefusion_sync", "stages") == "sequence"
        patches = setting.options.get("pipefusion_patches")
        if patches is not None:
            return _pipeline_step(m, n, patches, flows, sequence)
        rows = m.w.token_rows
        costs = [_pipeline_step(m, n, p, flows, sequence) for p in range(n, rows + 1) if rows % p == 0] or [
            _pipeline_step(m, n, default_patches(rows, n), flows, sequence)
        ]
        displaced = max(setting.displaced, 1)
        best = min(costs, key=lambda cost: displaced * cost.displaced_s + cost.fill_s)
        return dataclasses.replace(best, chosen={"pipefusion_patches": best.chosen["pipefusion_patches"]})

    @classmethod
    def check_world(cls, degree: int, config) -> None:
        """Refuse patch and stage counts that do not fit ``degree`` stages (one per rank of a CFG half)."""
        per_half = " per CFG half" if config.cfg_parallel else ""
        patches, stages = config.options.pipefusion_patches, config.options.pipefusion_stages
        if patches is not None and patches < degree:
            raise ParadiffError(
                f"pipefusion_patches={patches} is fewer than the {degree} pipeline stages (one per rank{per_half}): "
                f"some stages would never work; use pipefusion_patches >= {degree}, or None for the default"
            )
        if stages is not None and len(stages) != degree:
            raise ParadiffError(
                f"pipefusion_stages={list(stages)} gives {len(stages)} stages, but the pipeline has {degree} (one per "
                f"rank{per_half}); give one block count per stage"
            )

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        """Refuse, before any collective, a model whose blocks cannot form ``degree`` stages."""
        super().check_model(denoiser, family, degree, config)
        name = type(denoiser).__name__
        check_releasable(stage_blocks(denoiser, family.block_stack), cls.name)
        count = len(stage_blocks(denoiser, family.block_stack))
        if count < degree:
            raise ParadiffError(
                f"strategy='pipefusion' gives each of its {degree} stages (one per rank) at least one block, but "
                f"this {name} has {count} transformer blocks; run it on at most {count} ranks (per CFG half with "
                "cfg_parallel), or use strategy='patch'"
            )
        if not family.split_by_plan:  # every attention layer, not only a rank's own stage's: all ranks refuse alike
            plan_kv_completion(family, family.self_attention(denoiser), lambda name: (None, None), cls.name)
        if config.options.pipefusion_sync == "sequence" and loaded_stage(denoiser) is not None:
            raise ParadiffError(
                "pipefusion_sync='sequence' runs every block on every rank, but this pipeline was loaded with one "
                "stage's blocks per rank (load_stage_pipeline); load the whole pipeline, or leave pipefusion_sync "
                "at 'stages'"
            )
        stages = config.options.pipefusion_stages
        if stages is not None and sum(stages) != count:
            raise ParadiffError(
                f"pipefusion_stages={list(stages)} cuts {sum(stages)} blocks, but this {name} has {count} transformer "
                "blocks; give block counts that add up to it"
            )

    def check_height(self, denoiser: nn.Module, degree: int, height: int, vae_scale_factor: int) -> None:
        """Fail before any work when ``height`` pixels cannot be cut into the patches of whole rows."""
        pixels = family_of(denoiser).pixels_per_row(denoiser, vae_scale_factor)
        if height % pixels:
            raise ParadiffError(f"height {height} is not a multiple of {pixels} pixels per row of tokens")
        rows = height // pixels
        plan_patches(rows, self.options.pipefusion_patches, degree, pixels)
        if self.options.pipefusion_sync == "sequence":
            check_row_bands(rows, degree, pixels)

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> PipeFusionInstallation:
        """Keep this rank's stage of ``denoiser``'s blocks, free the others', hook it to run as a pipeline."""
        stack = family.block_stack
        blocks = [block for _, block in stage_blocks(denoiser, stack)]
        cut = loaded_cut(denoiser, comm.rank) or self.options.pipefusion_stages
        cut = cut or balanced_cut(measured_costs(family, denoiser, blocks, comm), comm.size)
        first = sum(cut[: comm.rank])
        mine = range(first, first + cut[comm.rank])
        installed = PipeFusionInstallation(denoiser, self.name, comm, blocks, cut)
        block_hooks = {i: PassThroughHook(stack) for i in range(len(blocks)) if i != first}

        def forwards(indices) -> Callable[[], list]:  # the blocks' own forwards, beneath the hooks registered below
            return lambda: [(blocks[i], block_hooks[i].fn_ref.original_forward) for i in indices]

        flows, why = self.flows(comm)
        sequence = self.options.pipefusion_sync == "sequence"
        whole = Stage(stack, comm, forwards(range(len(blocks)))) if sequence else None
        call = installed.call = PipelineCall(comm, stack, Stage(stack, comm, forwards(mine)), flows, why, whole)
        own_modules = {id(m) for i in mine for m in blocks[i].modules()}
        attention = family.self_attention(denoiser)
        own = [name for name, attn in attention if id(attn) in own_modules]

        def kv_pair(name: str, keeps: bool | None = None) -> tuple[PatchKV, PatchKV]:  # keeps None: ``name`` a layer's
            keeps = name in own if keeps is None else keeps
            return tuple(PatchKV(comm, f"{installed.hook_name}.{name}.{p}", call, keeps) for p in "kv")

        # in row bands every attention layer runs here (another stage's keeps nothing); else only the stage's own
        layers = [(name, attn) for name, attn in attention if sequence or name in own]
        if family.split_by_plan:  # K/V completed where attention is computed (per call of it), whatever the processor
            text = PatchText(comm, family.joint_text_first)
            kv_hooks = [
                (attn, SDPACompletionHook(name, self.name, functools.partial(kv_pair, keeps=name in own), text))
                for name, attn in layers
            ]
            processors = []
        else:
            kv_hooks, processors = plan_kv_completion(family, layers, kv_pair, self.name)

        installed.hook(denoiser, PipelineCallHook(family, call, self.options.pipefusion_patches, vae_scale_factor))
        block_hooks[first] = StageEntryHook(call, stack_first=first == 0)
        if sequence and first:
            block_hooks[0] = StageEntryHook(call, stage_first=False, stack_first=True)
        for index, block in enumerate(blocks):
            installed.hook(block, block_hooks[index])
        for module, layer_hook in kv_hooks:
            installed.hook(module, layer_hook)
        for attn, processor in processors:
            installed.set_processor(attn, processor)
        stage_modules = [(name, m) for name, m in denoiser.named_modules() if id(m) in own_modules]
        projections = prompt_projections(stage_modules)
        if family.prompt_embedder is not None:
            projections.append((family.prompt_embedder, denoiser.get_submodule(family.prompt_embedder)))
        for name, projection in projections:
            installed.hook(projection, PromptProjectionHook(comm, f"{installed.hook_name}.{name}"))
        installed.released = {} if sequence else release_other_stages(denoiser, blocks, cut, comm.rank)
        installed.on_remove(installed.restore)
        return installed.done()

    def flows(self, comm: Communicator) -> tuple[bool, str]:
        """Whether denoiser calls may flow into the next one, and why not."""
        if not self.options.pipefusion_flow:
            return False, "pipefusion_flow=False: each call drains"
        if comm.state.guard is not None:
            return False, "fidelity_floor_db: each call drains, since whether a call refreshes is decided as it starts"
        if self.groups is not None and self.groups.cfg is not None:
            return False, CFG_HALVES_DRAIN
        return True, ""


def _pipeline_step(m: CostMachine, n: int, patches: int, flows: bool, sequence: bool = False) -> StepCost:
    """The step of N = ``n`` stages over ``patches`` patches per call, flowing from call to call or draining;
    exact steps in row bands with ``sequence``."""
    w, groups, calls = m.w, m.groups, m.calls
    stage = max(balanced_sums(tuple(f / groups for f in w.unit_flops), n))
    outside = (w.flops - w.stack_flops) / groups  # embeddings and head: every rank, every call
    boundary = max(w.unit_output_bytes, default=0.0) / groups
    slot = m.compute(stage / (calls * patches), calls=1 / (n * calls))  # one patch through one stage
    sync, sync_bytes = (
        _sequence_step(m, n, outside, boundary) if sequence else (_sync_step(m, n, stage, outside, boundary), boundary)
    )
    transfer = m.transfer(boundary, calls * patches)
    kv = w.kv_bytes / groups / n  # this stage's layers' buffers of the whole image, per call of a step
    weights = (w.params if sequence else w.params - w.stack_params + w.stack_params / n) * w.itemsize
    if not flows:
        compute = calls * (patches + n - 1) * slot + m.compute(outside, calls=0)
        memory = weights + kv
        return StepCost(
            sync, m.displaced(compute, transfer), sync_bytes, boundary, memory, 0.0, {"pipefusion_patches": patches}
        )
    around = m.compute(outside / calls, calls=0) + m.hw.call_overhead_s  # a forward around the blocks
    latents = w.latent_bytes / groups  # the next latent, from the last stage to the first, per worked-out patch
    ring = m.transfer(latents / calls, 1)
    late = max(0.0, 2 * around + ring - (patches - n) * slot)  # when the next latent comes later than needed
    vote = m.transfer(8.0, 1)
    compute = calls * (patches * slot + (n - 1) * around + vote + late) + m.compute(outside, calls=0)
    transfer += m.transfer(latents * (n - 1), calls * (n - 1))
    memory = weights + kv * (1 + (n - 1) / patches)  # + what the patches worked out ahead overwrite, kept to undo
    nbytes = max(boundary, latents * (n - 1))  # the busiest rank: a stage's patches, or the last stage's latents
    chosen = {"pipefusion_patches": patches}
    return StepCost(sync, m.displaced(compute, transfer), sync_bytes, nbytes, memory, (n - 1) * slot, chosen)


def _sync_step(m: CostMachine, n: int, stage: float, outside: float, boundary: float) -> float:
    """An exact step: each call's samples pass whole through the stages one after the other, so with S samples per
    call the stages work side by side on S + N − 1 slots of one sample each (one device's time when S = 1)."""
    samples = m.samples_per_call
    exchanges = m.calls * (n - 1) * samples
    if samples == 1:
        return m.compute(m.w.flops / m.groups, shared=False) + m.transfer(boundary * (n - 1), exchanges)
    piece = m.compute(stage / (m.calls * samples), calls=1 / (n * m.calls * samples))
    return m.calls * (samples + n - 1) * piece + m.compute(outside, calls=0) + m.transfer(boundary * (n - 1), exchanges)


def _sequence_step(m: CostMachine, n: int, outside: float, boundary: float) -> tuple[float, float]:
    """Seconds and bytes sent of an exact step in row bands: 1/N of the blocks' tokens on every rank (the
    embeddings and head whole), each attention layer's keys and values of the other bands and the blocks' output
    bands gathered, waited for."""
    w = m.w
    blocks = m.compute((w.flops / m.groups - outside) / n) + m.compute(outside, calls=0)
    nbytes = (w.kv_bytes + boundary * m.calls) / m.groups * (n - 1) / n
    return blocks + m.transfer(nbytes, m.calls * (2 * w.attention_layers + 1)), nbytes


def default_patches(token_rows: int, stages: int) -> int:
    """The default patch count: the divisor of the token rows nearest twice the stages."""
    divisors = [d for d in range(stages, token_rows + 1) if token_rows % d == 0] or [token_rows]
    return min(divisors, key=lambda d: (abs(d - 2 * stages), d))


class PipeFusionInstallation(Installation):
    """Also frees the other stages' parameters; :meth:`restore` brings them back from the ranks that kept them."""

    def __init__(self, model: nn.Module, strategy: str, comm: Communicator, blocks: list[nn.Module], cut):
        super().__init__(model, strategy)
        self.comm = comm
        #: Every block, in the order the forward runs them, and how many of them each stage holds.
        self.blocks, self.cut = blocks, tuple(cut)
        #: Shapes of the parameters freed on this rank (the other stages'), by ``id`` of the parameter.
        self.released: dict[int, torch.Size] = {}
        self.call: PipelineCall | None = None

    @contextlib.contextmanager
    def steer(self, pipe):
        """For one ``pipe(...)`` call: the forecast of the pipeline's next denoiser call, from its scheduler."""
        call = self.call
        if not call.flows:
            yield
            return
        family = family_of(self.model)
        call.forecast = NextCall(pipe.scheduler, family.latent_arg, family.timestep_arg)
        try:
            with call.forecast.watch():
                yield
        finally:
            call.forecast = None

    def per_rank(self) -> set[int]:
        """The blocks' parameters, where each rank kept only its stage's; none where every rank kept every block."""
        return {id(param) for param in params_of(self.blocks)} if self.released else set()

    def restore(self) -> None:
        """Every rank takes part in one broadcast per parameter of every stage, from the rank that kept it; the
        model is then whole, even if it was loaded by stage. Where every rank kept every block (exact calls in row
        bands) there is nothing to bring back, on every rank alike."""
        if not self.released and loaded_stage(self.model) is None:
            return
        for stage, blocks in enumerate(stage_groups(self.blocks, self.cut)):
            for param in params_of(blocks):
                if id(param) in self.released:
                    param.data = param.data.new_empty(self.released.pop(id(param)))
                self.comm.wait([self.comm.broadcast(param.data, stage)[0]])
        if loaded_stage(self.model) is not None:
            delattr(self.model, LOADED_STAGE_ATTRIBUTE)
