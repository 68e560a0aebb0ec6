"""A pipeline of stages that flows from one denoiser call into the next (``pipefusion``).

The pipeline's own loop runs between two denoiser calls (CFG combine, scheduler step, callbacks), so a
pipeline of N stages that waits for it drains at the end of every call: each rank idles for N−1 of
M+N−1 patch slots. Here stage 0 starts patch p of the next call as soon as the last stage has finished
patch p of this one, so each rank idles only while the pipeline first fills:

* the last stage, having finished patch p < N−1, runs the denoiser around its blocks (embeddings and
  head only, its blocks bypassed) on the output so far, and works out the next call's latent at those
  rows the way the pipeline's loop will (:mod:`paradiff.stages.next_call`); it sends it to stage 0;
* stage 0 runs the denoiser up to its first block on that latent (with the next call's timestep and
  arguments) and takes patch p's tokens; stage s < N−1 computes the next call's patches 0..N−2−s once
  it has them, after this call's patches, in the same order, so every attention layer's buffer sees its
  patches in the same order as when the pipeline drains: flowing computes what draining computes;
* the next call, when the pipeline makes it, is checked against what was computed ahead: every rank
  compares the block inputs it used with the real ones bit for bit (stage 0 the patches' tokens too), and
  the ranks agree with one all-reduce. If anything differs (a callback that edits latents, a scheduler or
  guidance the forecast does not reproduce), the keys and values the work ahead wrote are put back, the
  call runs as a draining one, and the pipeline drains from then on; ``comm_stats`` says so (``flow``).

Messages between the stages carry a tag per call and patch, reserved on every rank alike (a call's tags
in the call before it when it flows into it). Each receive is posted one work item ahead of its use, and
in a shared pair of ranks (N = 2: the last stage's latent to stage 0 travels against the patches) never
before a send its message depends on, which is what NCCL, which runs a pair's transfers in the order they
were posted, needs.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..layers.batch_split import batch_rows
from ..layers.split import output_sample
from ..models.base import BlockStack
from ..runtime.comm import Communicator
from .link import StageLink
from .next_call import Upcoming
from .streams import block_output

if TYPE_CHECKING:
    from .blocks import PipelineCall


@dataclass
class StageInputs:
    """The first block's arguments of one call as this stage got them: the bound arguments (whose image, text and
    per-token tables each patch replaces), the whole image and text tokens, the per-token tables, and a copy of
    the arguments as they came (what the check of work done ahead compares)."""

    bound: inspect.BoundArguments
    image: torch.Tensor
    text: torch.Tensor | None
    per_token: dict
    arguments: dict

    @classmethod
    def of(cls, stack: BlockStack, bound: inspect.BoundArguments) -> StageInputs:
        inputs = bound.arguments
        text = inputs.get(stack.text_arg) if stack.text_arg else None
        per_token = {name: inputs[name] for name in stack.per_token if inputs.get(name) is not None}
        return cls(bound, inputs[stack.image_arg], text, per_token, dict(inputs))

    def message_shape(self, patches: int, samples: int) -> tuple[int, int]:
        """``(samples, size)`` of a patch's message: its image tokens, then the text tokens when they flow."""
        _, tokens, width = self.image.shape
        return samples, tokens // patches * width + (0 if self.text is None else self.text[0].numel())

    def sample_passes(self, stages: int) -> int:
        """How many passes of whole samples a call in one patch runs in: one per sample when the stages are several
        (the samples of a batch never meet, so sample ``b`` may enter stage 0 while stage 1 works on sample
        ``b − 1``, and the pipeline is exact), else one pass of the whole batch."""
        return self.image.shape[0] if stages > 1 else 1


@dataclass
class Bypass:
    """A forward of the denoiser around its blocks: the stage's first block records its inputs and hands on
    ``inject`` (the last stage's output so far) or its own input."""

    stack: BlockStack
    inject: torch.Tensor | None = None
    captured: StageInputs | None = None
    output: object = None

    def at_entry(self, entry, bound: inspect.BoundArguments):
        self.captured = StageInputs.of(self.stack, bound)
        image = self.captured.image if self.inject is None else self.inject
        return block_output(self.stack, entry, image, self.captured.text)


@dataclass(frozen=True)
class NextCall:
    """The call this one flows into: the forecast, the step state's names for it and its arguments (with this
    call's latent standing in for a new step's)."""

    upcoming: Upcoming
    context: str | None
    step: int
    slot: int
    arguments: dict


@dataclass
class Ahead:
    """What this stage computed of the coming call: its first ``count`` patches (of ``patches``), and for each the
    block inputs it used: the arguments but the image tokens, and (stage 0) the patch's image tokens."""

    patches: int
    count: int
    used: list[tuple[dict, torch.Tensor | None]] = field(default_factory=list)

    def add(self, inputs: StageInputs, stack: BlockStack, tokens: torch.Tensor | None) -> None:
        arguments = {name: value for name, value in inputs.arguments.items() if name != stack.image_arg}
        self.used.append((arguments, None if tokens is None else tokens.clone()))

    def matches(self, real: StageInputs, stack: BlockStack) -> bool:
        """Whether every block input this stage computed on equals the real call's, bit for bit (stage 0: the text
        and the patches' image tokens too; the other stages got those from the stage before)."""
        per_patch = real.image.shape[1] // self.patches
        for index, (arguments, tokens) in enumerate(self.used):
            skip = {stack.image_arg} | ({stack.text_arg} if tokens is None and stack.text_arg else set())
            if any(not _same(arguments.get(name), v) for name, v in real.arguments.items() if name not in skip):
                return False
            if tokens is not None and not _same(tokens, real.image[:, index * per_patch : (index + 1) * per_patch]):
                return False
        return True


class KVUndo:
    """The keys and values work done ahead overwrote in the attention layers' buffers, to put back if it is
    discarded (installation-wide; used only while :meth:`recording`)."""

    def __init__(self):
        self.active = False
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextmanager
    def recording(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def keep(self, target: torch.Tensor) -> None:
        """``target`` (a view into a buffer) is about to be overwritten."""
        if self.active:
            self.kept.append((target, target.clone()))

    def restore(self) -> None:
        for target, old in reversed(self.kept):
            target.copy_(old)
        self.kept = []

    def clear(self) -> None:
        self.kept = []


class StageFlow:
    """This rank's stage over the denoiser calls of one ``pipe(...)`` call (made per call, drained at its end)."""

    def __init__(self, comm: Communicator, call: PipelineCall):
        self.comm, self.call = comm, call
        self.link = StageLink(comm)
        #: The running call's index in the ``pipe(...)`` call; message tags by call (stage to stage, last to first).
        self.index = -1
        self.tags: dict[int, range] = {}
        self.ring: dict[int, range] = {}
        self.ahead: Ahead | None = None
        #: Why the pipeline drains from now on (every rank alike); None while it may flow.
        self.stopped: str | None = None
        if not call.flows:
            self._stop(call.why_not_flowing)

    @torch.compiler.disable
    def begin_call(self) -> None:
        self.index += 1
        self.link.begin_call()

    def drain(self) -> None:
        self.link.drain()

    # One call.

    @torch.compiler.disable(recursive=False)
    def run(self, entry, bound: inspect.BoundArguments):
        """Every patch of this call through the stage, then the next call's first ones if it flows into it;
        returns what the model's forward expects of ``entry``, the stage's first block.

        Under ``torch.compile`` this bookkeeping runs as plain Python (tags, votes and transfers are no graph's
        business), while the blocks' forwards it calls are compiled."""
        comm, call = self.comm, self.call
        stack, rank, size, k, patches = call.stack, comm.rank, comm.size, self.index, call.patches
        inputs = StageInputs.of(stack, bound)
        done, following = self._agree(inputs, patches) if patches > 1 else (0, None)
        passes = inputs.sample_passes(size) if patches == 1 else 1
        if k not in self.tags:
            self.tags[k] = comm.tags(patches * passes)
        ahead = size - 1 - rank if following is not None else 0
        if following is not None:
            self.tags[k + 1] = comm.tags(patches)
            if following.upcoming.new_step:
                self.ring[k] = comm.tags(size - 1)
        work = [(k, p) for p in range(done, patches * passes)] + [(k + 1, p) for p in range(ahead)]
        output = torch.zeros_like(inputs.image) if self.link.last else None
        later = self._around_blocks(following.arguments).captured if ahead and rank else None
        shape, texts = inputs.message_shape(patches, inputs.image.shape[0] // passes), []
        record = Ahead(patches, ahead)
        for i, (c, p) in enumerate(work):
            for item in work[i : i + 2]:
                self._post(item, following, shape, inputs)
            if c == k:
                x, t = self._own_patch(inputs, p, output, following, passes)
                if output is not None:
                    texts.append(t)
                    continue
                step = comm.state.step
            else:
                x, t = self._patch_ahead(following, p, later, record)
                step = following.step
            self.link.send_to(rank + 1, self.tags[c][p], _message(x, t), step=step)  # counted in its call's step
        if following is not None and rank > 0:
            self._post((k + 1, ahead), following, shape, inputs)
        self.link.finish()
        if following is not None:
            self.ahead = record
            self._count(ahead)
        if output is None:
            return block_output(stack, entry, inputs.image, inputs.text)
        text = texts[-1] if passes == 1 or texts[-1] is None else torch.cat(texts)
        return block_output(stack, entry, output, text)

    def _own_patch(
        self, inputs: StageInputs, p: int, output: torch.Tensor | None, following: NextCall | None, passes: int
    ):
        """Patch ``p`` of the running call through the stage (with ``passes`` > 1, the whole sequence of the ``p``-th
        of that many equal parts of the batch); the last stage writes it into ``output`` and, when the next call
        is a new step's, sends stage 0 that step's latent as far as it is known."""
        patches, (batch, tokens, _) = self.call.patches, inputs.image.shape
        per_patch, per_pass = tokens // patches, batch // passes
        span = slice(p * per_patch, (p + 1) * per_patch) if passes == 1 else slice(None)
        samples = slice(p * per_pass, (p + 1) * per_pass) if passes > 1 else None
        rows, patch = (slice(None), p) if samples is None else (samples, 0)
        if self.comm.rank == 0:
            x, t = inputs.image[rows, span], batch_rows(inputs.text, batch, rows)
            x, t = self.call.stage.run_patch(inputs, patch, patches, x, t, samples)
        else:
            x, t, buffer = self._received(self.index, p, inputs)
            x, t = self.call.stage.run_patch(inputs, patch, patches, x, t, samples)
            self.link.release(buffer)
        if output is not None:
            output[rows, span] = x
            if following is not None and following.upcoming.new_step and p < self.comm.size - 1:
                self._send_latent(output, p)
        return x, t

    def _patch_ahead(self, following: NextCall, p: int, later: StageInputs | None, record: Ahead):
        """Patch ``p`` of the next call through the stage, in that call's buffers, keeping what it overwrites; its
        inputs (stage 0: worked out here; the others: ``later``, from the stage before) go into ``record``."""
        call, patches = self.call, self.call.patches
        with self.comm.state.as_call(following.context, following.step, following.slot), call.undo.recording():
            if self.comm.rank == 0:
                later = self._inputs_ahead(following, p)
                per_patch = later.image.shape[1] // patches
                x, t, buffer = later.image[:, p * per_patch : (p + 1) * per_patch], later.text, None
            else:
                x, t, buffer = self._received(self.index + 1, p, later)
            record.add(later, call.stack, x if buffer is None else None)
            x, t = call.stage.run_patch(later, p, patches, x, t)
        if buffer is not None:
            self.link.release(buffer)
        return x, t

    # Agreeing on the flow.

    def _agree(self, inputs: StageInputs, patches: int) -> tuple[int, NextCall | None]:
        """Whether the work done ahead for this call stands, and which call this one flows into; every rank agrees
        (one all-reduce). Returns the patches already done and the call flowed into (None: this call drains)."""
        ahead, self.ahead = self.ahead, None
        if self.stopped is not None and ahead is None:
            return 0, None
        ok = ahead is None or (ahead.patches == patches and ahead.matches(inputs, self.call.stack))
        following = self._following(patches) if self.stopped is None else None
        votes = self.comm.all_reduce(torch.tensor([int(ok), int(following is not None)], device=self.comm.device))
        size = self.comm.size
        if ahead is not None and int(votes[0]) < size:
            self.call.undo.restore()
            self.link.discard()
            del self.tags[self.index]
            refusal = self.call.forecast.refusal if self.call.forecast is not None else None
            why = refusal or "a callback that edits the latents, or a loop step the forecast does not reproduce"
            self._stop(
                f"at step {self.comm.state.step} the pipeline's call differed from the one worked out ahead ({why}); "
                "the pipeline drains from there"
            )
            return 0, None
        self.call.undo.clear()
        return (ahead.count if ahead else 0), (following if int(votes[1]) == size else None)

    def _following(self, patches: int) -> NextCall | None:
        """The call this one can flow into: forecast, displaced, in as many patches, its buffers filled; else None."""
        forecast = self.call.forecast
        upcoming = forecast.upcoming() if forecast is not None else None
        if upcoming is None:
            if forecast is not None and forecast.refusal is not None:  # reported; the ranks still vote every call
                self.comm.stats.flow_record().stopped = self.stopped or forecast.refusal
            return None
        arguments = forecast.arguments(upcoming)
        state = self.comm.state
        step, slot = state.peek(upcoming.context, arguments[forecast.timestep_arg])
        with state.as_call(upcoming.context, step, slot):
            if state.synchronous or not self.call.filled():
                return None
        return NextCall(upcoming, upcoming.context, step, slot, arguments)

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
        self.comm.stats.flow_record().stopped = self.stopped

    def _count(self, ahead: int) -> None:
        record = self.comm.stats.flow_record()
        record.calls_flowing += 1
        record.patches_ahead += ahead

    # The work ahead.

    def _around_blocks(self, arguments: dict, inject: torch.Tensor | None = None) -> Bypass:
        """The denoiser's forward beneath paradiff's hook on ``arguments``, its blocks bypassed (``inject`` handed on
        by the stage's first block): what the stage's first block got, and the model's output."""
        call = self.call
        bypass = call.bypass = Bypass(call.stack, inject)
        try:
            bypass.output = call.forward(inspect.BoundArguments(call.signature, arguments))
        finally:
            call.bypass = None
        return bypass

    def _inputs_ahead(self, following: NextCall, patch: int) -> StageInputs:
        """Stage 0: the next call's block inputs, right at ``patch`` (a new step's latent from the last stage)."""
        arguments = following.arguments
        if following.upcoming.new_step:
            latent = self.link.take(("ring", self.index, patch))
            arguments = self.call.forecast.arguments(following.upcoming, latent)
            captured = self._around_blocks(arguments).captured
            self.link.release(latent)
            return captured
        return self._around_blocks(arguments).captured

    def _send_latent(self, output: torch.Tensor, patch: int) -> None:
        """The last stage: the next step's latent, right at the rows done so far, to stage 0."""
        forecast = self.call.forecast
        bypass = self._around_blocks(forecast.current[-1].arguments, inject=output)
        latent = forecast.latent_after(output_sample(bypass.output))
        self.link.send_to(0, self.ring[self.index][patch], latent, step=self.comm.state.step)

    # Messages.

    def _post(self, item: tuple[int, int], following: NextCall | None, shape, inputs: StageInputs) -> None:
        """Post the receive of work item ``item`` (call, patch) if it needs one."""
        c, p = item
        if self.comm.rank > 0:
            self.link.post(item, self.comm.rank - 1, self.tags[c][p], shape, inputs.image)
        elif c > self.index and following.upcoming.new_step:
            latent = following.arguments[self.call.forecast.latent_arg]
            self.link.post(("ring", self.index, p), self.comm.size - 1, self.ring[self.index][p], latent.shape, latent)

    def _received(self, c: int, p: int, inputs: StageInputs):
        """Patch ``p`` of call ``c`` from the previous stage: its image tokens, the text tokens (when they flow) and
        the buffer they are views of (to release once read)."""
        buffer = self.link.take((c, p))
        _, tokens, width = inputs.image.shape
        batch, patches = buffer.shape[0], self.call.patches
        image_size = tokens // patches * width
        x = buffer[:, :image_size].reshape(batch, tokens // patches, width)
        t = buffer[:, image_size:].reshape(batch, *inputs.text.shape[1:]) if inputs.text is not None else None
        return x, t, buffer


def _message(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """A patch's image tokens, then its text tokens, as one message; one prompt for several images (Flux)
    broadcasts to the image batch in the first block."""
    t = None if t is None else t.expand(x.shape[0], *t.shape[1:])
    return torch.cat([x.flatten(1)] + ([] if t is None else [t.flatten(1)]), dim=1)


def _same(a, b) -> bool:
    """Whether two block arguments are equal, bit for bit for tensors (also inside tuples, lists and dicts)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    try:
        return a is b or bool(a == b)
    except Exception:
        return False
