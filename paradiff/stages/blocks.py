"""Hooks that run a DiT's blocks as a pipeline of stages over patches of token rows (``pipefusion``).

The denoiser's own forward still runs on every rank: embeddings, the loop over the blocks, the head.
Each block carries a hook. On the first block of this rank's stage the hook runs the whole stage over
every patch of the call (receiving each patch from the previous stage, sending it on to the next);
every other block hands its input on unchanged, because another rank computes it or the stage's run
already did. The last stage's run returns the whole sequence, so the head computes the true output
there; the hook on the denoiser then overwrites the other ranks' output with it.

A call runs the whole sequence as one patch (exact: every attention layer sees this step's keys and
values of every token) during warm-up, and in ``M`` patches of whole rows afterwards: each attention
layer keeps a buffer of the whole image's K/V (:class:`PatchKV`), overwrites the current patch's slice
and attends to the whole buffer, so patches done this step are fresh and the others one step stale.
``state.partition`` names the current patch (``parts`` = patches, ``rank`` = patch index), which is
what the K/V completion of every family reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.hooks import ModelHook
from torch import nn

from ..compat import CallContextHook, block_returns_image_first
from ..errors import ParadiffError
from ..layers.sdpa_kv import JointText
from ..layers.split import output_sample, replace_output_sample
from ..models.base import BlockStack, DenoiserFamily, Grid, bind_inputs, map_by_spec
from ..runtime.comm import Communicator
from ..runtime.step_state import RowPartition
from .link import StageLink


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


@dataclass
class KVSlot:
    """One layer's K (or V) buffer of the whole image, for one call context and call slot."""

    tensor: torch.Tensor | None = None


class PatchKV:
    """One attention layer's keys (or values) of the whole image, refreshed patch by patch.

    A whole-sequence call stores them; a patch call overwrites the patch's slice and returns the whole
    buffer. Buffers are kept per call context and call slot, in the layer's own dtype, and forgotten at
    every ``pipe(...)`` call (they live in the step state's per-run buffers). Attention processors must
    not modify the returned keys and values in place (the stock ones do not).
    """

    def __init__(self, comm: Communicator, name: str):
        self.comm, self.name = comm, name

    def complete(self, local: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        state = self.comm.state
        part, slot = state.partition, state.exchange(self.name, KVSlot)
        if part.parts == 1:
            slot.tensor = local
            return local
        slot.tensor.narrow(token_dim, part.row_start * part.cols, part.band_tokens).copy_(local)
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


class PipelineCall:
    """What the hooks of one denoiser share about the current call: its grid, patches and stage link."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.grid: Grid | None = None
        self.patches = 1

    @property
    def link(self) -> StageLink:
        return self.comm.state.exchange("paradiff.pipefusion.link", lambda: StageLink(self.comm))


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
        family, comm = self.family, self.call.comm
        inputs = bind_inputs(module, args, kwargs).arguments
        passed = [name for name in family.block_stack.unsupported_args if inputs.get(name) is not None]
        if passed:
            raise ParadiffError(
                f"strategy='pipefusion' cannot pass {', '.join(passed)} to the blocks of {type(module).__name__}; "
                "use strategy='patch' for such calls"
            )
        grid = family.grid(module, inputs[family.latent_arg], inputs)
        pixels = family.pixels_per_row(module, self.vae_scale_factor)
        patches = plan_patches(grid.rows, self.requested, comm.size, pixels)
        state = comm.state
        state.enter_call(self.context.name, inputs[family.timestep_arg])
        filled = state.exchange("paradiff.pipefusion.filled", KVFilled).value
        self.call.grid = grid
        self.call.patches = patches if filled and not state.synchronous else 1
        self.call.link.begin_call(self.call.patches)
        self.started = time.perf_counter()
        return args, kwargs

    def post_forward(self, module, output):
        state, link = self.call.comm.state, self.call.link
        sample = output_sample(output).contiguous()
        link.share_output(sample)
        state.exchange("paradiff.pipefusion.filled", KVFilled).value = True
        self.call.comm.stats.record_call(state.step, time.perf_counter() - self.started, link.idle_s)
        return replace_output_sample(output, sample)


def block_output(stack: BlockStack, block: nn.Module, image: torch.Tensor, text: torch.Tensor | None):
    """What ``block`` returns: the image tokens, or both streams in the block's own order when text flows through."""
    if stack.text_arg is None:
        return image
    return (image, text) if block_returns_image_first(type(block)) else (text, image)


def block_streams(block: nn.Module, output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image, text)`` from the two token streams ``block`` returned, in whichever order it returns them."""
    first, second = output
    return (first, second) if block_returns_image_first(type(block)) else (second, first)


class PassThroughHook(ModelHook):
    """On every block but the stage's first: hands the block's input on unchanged.

    Another rank holds the block, or this rank's stage run has already computed it.
    """

    def __init__(self, stack: BlockStack):
        super().__init__()
        self.stack = stack

    def new_forward(self, module, *args, **kwargs):
        inputs = bind_inputs(module, args, kwargs).arguments
        return block_output(self.stack, module, inputs[self.stack.image_arg], inputs.get(self.stack.text_arg))


class StageEntryHook(ModelHook):
    """On the first block of this rank's stage: runs the whole stage over every patch of the call."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.stage = stage

    def new_forward(self, module, *args, **kwargs):
        return self.stage.run(module, bind_inputs(module, args, kwargs))


class Stage:
    """This rank's contiguous blocks of the pipeline.

    ``forwards`` gives ``(block, its own forward beneath paradiff's hooks)`` for each of the stage's
    blocks, in block order; each block's output is read in that block's own order of the token streams.
    """

    def __init__(self, stack: BlockStack, call: PipelineCall, forwards: Callable[[], list[Callable]]):
        self.stack, self.call, self.forwards = stack, call, forwards

    def run(self, entry: nn.Module, bound):
        """Every patch through the stage; returns what the model's forward expects of ``entry``, the first block."""
        stack, call, link = self.stack, self.call, self.call.link
        state, grid, patches = call.comm.state, call.grid, call.patches
        inputs = bound.arguments
        image, text = inputs[stack.image_arg], inputs.get(stack.text_arg) if stack.text_arg else None
        batch, tokens, width = image.shape
        per_patch = tokens // patches
        # a patch travels as one message: its image tokens, then the text tokens (their width may differ: Mochi)
        sizes = [per_patch * width] + ([] if text is None else [text[0].numel()])
        if not link.first:
            link.expect(patches, (batch, sum(sizes)), image)
        output = torch.empty_like(image) if link.last else None
        per_token = {name: inputs.get(name) for name in stack.per_token if inputs.get(name) is not None}
        forwards = self.forwards()
        for m in range(patches):
            state.partition = RowPartition(grid.rows, grid.cols, patches, m)
            span = slice(m * per_patch, (m + 1) * per_patch)
            if link.first:
                x, t = image[:, span], text
            else:
                pieces = link.receive(m).split(sizes, dim=1)
                x = pieces[0].reshape(batch, per_patch, width)
                t = pieces[1].reshape(batch, *text.shape[1:]) if text is not None else None
            for name, table in per_token.items() if patches > 1 else ():
                inputs[name] = _cut_per_token(table, stack.per_token[name], tokens, span)
            for block, forward in forwards:
                inputs[stack.image_arg] = x
                if text is not None:
                    inputs[stack.text_arg] = t
                result = forward(*bound.args, **bound.kwargs)
                x, t = block_streams(block, result) if text is not None else (result, None)
            if link.last:
                output[:, span] = x
            else:
                # one prompt for several images (Flux) broadcasts to the image batch in the first block
                t = None if t is None else t.expand(batch, *t.shape[1:])
                link.send(m, torch.cat([x.flatten(1)] + ([] if t is None else [t.flatten(1)]), dim=1))
        link.finish()
        if not link.last:
            return block_output(stack, entry, image, text)
        return block_output(stack, entry, output, t)


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
