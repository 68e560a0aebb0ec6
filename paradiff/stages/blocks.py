"""Hooks that run a DiT's blocks as a pipeline of stages over patches of token rows (``pipefusion``).

The denoiser's own forward still runs on every rank: embeddings, the loop over the blocks, the head.
Each block carries a hook. On the first block of this rank's stage the hook runs the whole stage over
every patch of the call (receiving each patch from the previous stage, sending it on to the next; after
warm-up also the next call's first patches, :mod:`.flow`); every other block hands its input on
unchanged, because another rank computes it or the stage's run already did. The last stage's run
returns the whole sequence, so the head computes the true output there; the hook on the denoiser then
overwrites the other ranks' output with it.

A call runs the whole sequence as one patch (exact: every attention layer sees this step's keys and
values of every token) during warm-up, a pass per sample of its batch, and in ``M`` patches of whole rows
afterwards: each attention
layer keeps a buffer of the whole image's K/V (:class:`PatchKV`), overwrites the current patch's slice
and attends to the whole buffer, so patches done this step are fresh and the others one step stale.
``state.partition`` names the current patch (``parts`` = patches, ``rank`` = patch index), which is
what the K/V completion of every family reads.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.hooks import ModelHook
from torch import nn

from ..compat import CallContextHook
from ..errors import ParadiffError
from ..layers.batch_split import batch_rows
from ..layers.sdpa_kv import JointText
from ..layers.split import output_sample, replace_output_sample
from ..models.base import BlockStack, DenoiserFamily, Grid, bind_inputs, map_by_spec
from ..runtime.comm import SYNC, Communicator
from ..runtime.step_state import RowPartition
from .flow import Bypass, KVUndo, StageFlow, StageInputs
from .next_call import NextCall
from .streams import block_output, block_streams


def plan_patches(rows: int, requested: int | None, stages: int, pixels: int) -> int:
    """How many patches of whole rows a call of ``rows`` token rows runs in; raises naming the sizes that work.

    ``requested`` None: the divisor of ``rows`` nearest to twice the stages, and at least the stages.
    """
    height = rows * pixels
    if requested is None:
        if rows < stages:
            raise ParadiffError(
                f"strategy='pipefusion' gives each of its {stages} stages at least one row of tokens per patch, but "
                f"height {height} has only {rows} rows of {pixels} pixels; use a height of at least {stages * pixels}"
            )
        return min((m for m in range(stages, rows + 1) if rows % m == 0), key=lambda m: (abs(m - 2 * stages), m))
    if rows % requested == 0:
        return requested
    step = requested * pixels
    lower, upper = (height // step) * step, (height // step + 1) * step
    heights = f"{lower} or {upper}" if lower else str(upper)
    fits = [m for m in range(stages, rows + 1) if rows % m == 0]
    patches = f", or pipefusion_patches={' or '.join(map(str, fits))} at this height" if fits else ""
    raise ParadiffError(
        f"pipefusion_patches={requested} cuts the image into {requested} patches of whole token rows, but height "
        f"{height} has {rows} rows of {pixels} pixels, which is not divisible by {requested}; use height {heights}"
        f"{patches}"
    )


def check_row_bands(rows: int, ranks: int, pixels: int) -> None:
    """Refuse ``rows`` token rows that do not cut into one band of whole rows per rank (exact calls in row bands),
    naming the heights that do."""
    if rows % ranks == 0:
        return
    step = ranks * pixels
    lower = rows // ranks * step
    heights = f"{lower} or {lower + step}" if lower else str(step)
    raise ParadiffError(
        f"pipefusion_sync='sequence' runs exact calls in bands of whole token rows, one per rank, but height "
        f"{rows * pixels} has {rows} rows of {pixels} pixels, which is not divisible by {ranks} ranks; use height "
        f"{heights}"
    )


@dataclass
class KVSlot:
    """One layer's K (or V) buffer of the whole image, for one call context and call slot."""

    tensor: torch.Tensor | None = None


class PatchKV:
    """One attention layer's keys (or values) of the whole image, refreshed patch by patch.

    A whole-sequence call stores them (a pass of some of its samples, their rows); a patch call overwrites the
    patch's slice and returns the whole buffer. Buffers are kept per call context and call slot, in the layer's
    own dtype, and forgotten at every ``pipe(...)`` call (they live in the step state's per-run buffers). What
    work done ahead for the next call overwrites is kept in ``undo`` until that call confirms it. Attention
    processors must not modify the returned keys and values in place (the stock ones do not).
    """

    def __init__(self, comm: Communicator, name: str, call: PipelineCall, keeps: bool = True):
        self.comm, self.name, self.call = comm, name, call
        #: Whether the layer is this rank's stage's, whose buffer displaced calls read; another stage's layer runs
        #: here only in an exact call in row bands, which gathers its K/V and keeps nothing.
        self.keeps = keeps

    def complete(self, local: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        state = self.comm.state
        if self.call.sequence:  # an exact call in row bands: this step's K/V of every band
            whole = self.comm.all_gather_output(local, token_dim, kind=SYNC)
            if self.keeps:
                state.exchange(self.name, KVSlot).tensor = whole
            return whole
        part, slot = state.partition, state.exchange(self.name, KVSlot)
        if part.parts == 1 and part.samples is None:
            slot.tensor = local
            return local
        if part.parts == 1:  # a whole-sequence pass of some of the call's samples: their rows of the buffer
            if part.samples.start == 0:
                slot.tensor = local.new_empty((part.batch, *local.shape[1:]))
            slot.tensor[part.samples] = local
            return local
        target = slot.tensor.narrow(token_dim, part.row_start * part.cols, part.band_tokens)
        self.call.undo.keep(target)
        target.copy_(local)
        return slot.tensor


class PatchText(JointText):
    """The prompt tokens that join a patch's image tokens in self-attention: the patch's tokens are the image part."""

    def __init__(self, comm: Communicator, first: bool | None):
        super().__init__(first)
        self.comm = comm

    def image_count(self) -> int:
        return self.comm.state.partition.band_tokens


@dataclass
class KVFilled:
    """Whether a call context and call slot has run once this ``pipe(...)`` call, filling its K/V buffers."""

    value: bool = False


#: Why a pipeline of stages inside one CFG half drains at every call.
CFG_HALVES_DRAIN = (
    "with cfg_parallel the two CFG halves run on different ranks, and the next call's latent needs both: "
    "each call drains"
)


class PipelineCall:
    """What the hooks of one denoiser share: the stage, the current call's grid and patches, the forecast of the
    pipeline's next call (set for the length of each ``pipe(...)`` call) and the flow of the stages over it.

    ``forward`` runs the denoiser's forward beneath paradiff's hook on bound arguments (of ``signature``);
    ``flows`` (and ``why_not_flowing`` when it is False) says whether calls may flow into the next one.
    """

    def __init__(
        self,
        comm: Communicator,
        stack: BlockStack,
        stage: Stage,
        flows: bool,
        why_not_flowing: str = "",
        whole: Stage | None = None,
    ):
        self.comm, self.stack, self.stage = comm, stack, stage
        self.flows, self.why_not_flowing = flows, why_not_flowing
        #: Every block, when exact calls run in row bands on every rank (``pipefusion_sync="sequence"``); None when
        #: they pass the stages.
        self.whole = whole
        #: Whether the running call is exact in row bands.
        self.sequence = False
        self.patches = 1
        self.undo = KVUndo()
        self.forecast: NextCall | None = None
        self.bypass: Bypass | None = None
        self.signature: inspect.Signature | None = None
        self.forward: Callable | None = None

    @property
    def flow(self) -> StageFlow:
        return self.comm.state.per_run("paradiff.pipefusion.flow", lambda: StageFlow(self.comm, self))

    def filled(self) -> bool:
        """Whether the current call slot has run once (its K/V buffers hold the whole image)."""
        return self.comm.state.exchange("paradiff.pipefusion.filled", KVFilled).value

    @torch.compiler.disable(recursive=False)
    def sequence_pass(self, entry: nn.Module, bound: inspect.BoundArguments):
        """An exact call in row bands: every block on this rank's band of the image tokens (each attention layer
        gathers this step's keys and values of every band, :class:`PatchKV`), then the bands gathered; returns
        what the model's forward expects of ``entry``, the first block. Under ``torch.compile`` the blocks'
        forwards are compiled, the gathers between them are not."""
        comm, stack = self.comm, self.stack
        inputs = StageInputs.of(stack, bound)
        per_band = inputs.image.shape[1] // comm.size
        band = inputs.image[:, comm.rank * per_band : (comm.rank + 1) * per_band]
        x, t = self.whole.run_patch(inputs, comm.rank, comm.size, band, inputs.text)
        return block_output(stack, entry, comm.all_gather_output(x, 1, kind=SYNC), t)


class PipelineCallHook(CallContextHook):
    """On the denoiser: counts the step, decides the call's patches, shares the last stage's output."""

    def __init__(
        self, family: DenoiserFamily, call: PipelineCall, requested_patches: int | None, vae_scale_factor: int
    ):
        super().__init__()
        self.family, self.call, self.vae_scale_factor = family, call, vae_scale_factor
        self.requested = requested_patches
        self.started = 0.0

    def pre_forward(self, module, *args, **kwargs):
        family, call, comm = self.family, self.call, self.call.comm
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        passed = [name for name in family.block_stack.unsupported_args if inputs.get(name) is not None]
        if passed:
            raise ParadiffError(
                f"strategy='pipefusion' cannot pass {', '.join(passed)} to the blocks of {type(module).__name__}; "
                "use strategy='patch' for such calls"
            )
        grid = family.grid(module, inputs[family.latent_arg], inputs)
        pixels = family.pixels_per_row(module, self.vae_scale_factor)
        patches = plan_patches(grid.rows, self.requested, comm.size, pixels)
        if call.whole is not None:  # a call whose height was not checked before it (the pipeline's default)
            check_row_bands(grid.rows, comm.size, pixels)
        state = comm.state
        state.enter_call(self.context.name, inputs[family.timestep_arg])
        if call.forecast is not None:
            call.forecast.observe_call(self.context.name, inputs)
        exact = not call.filled() or state.synchronous
        call.sequence = exact and call.whole is not None
        for stage in (call.stage, call.whole):
            if stage is not None:
                stage.grid = grid
        call.patches = 1 if exact else patches
        call.signature, call.forward = bound.signature, self._beneath
        call.flow.begin_call()
        self.started = time.perf_counter()
        return args, kwargs

    def _beneath(self, bound: inspect.BoundArguments):
        return self.fn_ref.forward(*bound.args, **bound.kwargs)  # the forward inside this hook

    def post_forward(self, module, output):
        call = self.call
        state, link = call.comm.state, call.flow.link
        sample = output_sample(output).contiguous()
        link.share_output(sample)
        state.exchange("paradiff.pipefusion.filled", KVFilled).value = True
        if call.forecast is not None:
            call.forecast.observe_output(sample)
        call.comm.stats.record_call(state.step, time.perf_counter() - self.started, link.idle_s)
        return replace_output_sample(output, sample)


class PassThroughHook(ModelHook):
    """On every block but the stage's first: hands the block's input on unchanged.

    Another rank holds the block, or this rank's stage run has already computed it.
    """

    def __init__(self, stack: BlockStack):
        super().__init__()
        self.stack = stack

    def new_forward(self, module, *args, **kwargs):
        return handed_on(self.stack, module, bind_inputs(module, args, kwargs))


def handed_on(stack: BlockStack, block: nn.Module, bound: inspect.BoundArguments):
    """What ``block``'s forward returns when it hands its input on unchanged."""
    inputs = bound.arguments
    return block_output(stack, block, inputs[stack.image_arg], inputs.get(stack.text_arg))


class StageEntryHook(ModelHook):
    """On the first block of this rank's stage: runs the stage over the call's patches (:mod:`.flow`), or, in a
    forward around the blocks, records the stage's inputs and hands them on. In an exact call in row bands the
    hook on the first block of all (``stack_first``) runs every block instead, and the others hand their input on.
    """

    def __init__(self, call: PipelineCall, stage_first: bool = True, stack_first: bool = False):
        super().__init__()
        self.call, self.stage_first, self.stack_first = call, stage_first, stack_first

    def new_forward(self, module, *args, **kwargs):
        call = self.call
        bound = bind_inputs(module, args, kwargs)
        if call.sequence and self.stack_first:
            return call.sequence_pass(module, bound)
        if call.sequence or not self.stage_first:
            return handed_on(call.stack, module, bound)
        if call.bypass is not None:
            return call.bypass.at_entry(module, bound)
        return call.flow.run(module, bound)


class Stage:
    """This rank's contiguous blocks of the pipeline.

    ``forwards`` gives ``(block, its own forward beneath paradiff's hooks)`` for each of the stage's
    blocks, in block order; each block's output is read in that block's own order of the token streams.
    """

    def __init__(self, stack: BlockStack, comm: Communicator, forwards: Callable[[], list[Callable]]):
        self.stack, self.comm, self.forwards = stack, comm, forwards
        self.grid: Grid | None = None

    def run_patch(
        self,
        inputs: StageInputs,
        patch: int,
        patches: int,
        x: torch.Tensor,
        t: torch.Tensor | None,
        samples: slice | None = None,
    ):
        """Patch ``patch`` of ``patches`` (image tokens ``x``, text tokens ``t`` when they flow) through the stage's
        blocks, with ``inputs``' other arguments (cut to the batch's ``samples`` when given, in a whole-sequence
        pass of some samples); returns its image and text tokens after the stage."""
        stack, bound = self.stack, inputs.bound
        grid, batch = self.grid, inputs.image.shape[0]
        self.comm.state.partition = RowPartition(grid.rows, grid.cols, patches, patch, samples, batch)
        tokens = inputs.image.shape[1]
        per_patch = tokens // patches
        span = slice(patch * per_patch, (patch + 1) * per_patch)
        for name, table in inputs.per_token.items() if patches > 1 else ():
            bound.arguments[name] = _cut_per_token(table, stack.per_token[name], tokens, span)
        for name, value in inputs.arguments.items() if samples is not None else ():
            if name in stack.per_token:
                bound.arguments[name] = _cut_samples(value, stack.per_token[name], batch, samples)
            elif name not in (stack.image_arg, stack.text_arg):
                bound.arguments[name] = batch_rows(value, batch, samples)
        for block, forward in self.forwards():
            bound.arguments[stack.image_arg] = x
            if t is not None:
                bound.arguments[stack.text_arg] = t
            result = forward(*bound.args, **bound.kwargs)
            x, t = block_streams(block, result) if t is not None else (result, None)
        return x, t


def _cut_samples(value, spec, batch: int, samples: slice):
    """A per-token table (or tuple of them) cut to the batch's ``samples`` where it holds the batch: a table whose
    first dimension is its tokens (``spec.split_dim`` 0, Flux's rotary table) has none to cut."""
    return map_by_spec(value, spec, lambda table, one: batch_rows(table, batch, samples) if one.split_dim else table)


def _cut_per_token(value, spec, image_tokens: int, span: slice):
    """A per-token table (or tuple of them) cut to the patch ``span`` of the ``image_tokens``.

    ``spec`` says where its tokens lie (``BlockStack.per_token``); entries before the image tokens' (the
    text tokens' in a joint table) are kept.
    """

    def cut(table: torch.Tensor, one) -> torch.Tensor:
        dim = one.split_dim
        text = table.shape[dim] - image_tokens
        patch = table.narrow(dim, text + span.start, span.stop - span.start)
        return torch.cat([table.narrow(dim, 0, text), patch], dim=dim) if text else patch

    return map_by_spec(value, spec, cut)


def stage_blocks(model: nn.Module, stack: BlockStack) -> list[tuple[str, nn.Module]]:
    """Every block of ``stack`` as ``(name, module)``, in the order the forward runs them."""
    return [(f"{name}.{index}", block) for name in stack.lists for index, block in enumerate(getattr(model, name))]
