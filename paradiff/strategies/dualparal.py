"""Frame blocks × layer stages for long videos (DualParal, "Minute-Long Videos with Dual Parallelisms").

What runs. The pipeline is diffusers' ``SkyReelsV2DiffusionForcingPipeline`` with its own asynchronous
schedule, unchanged: ``causal_block_size=B`` cuts the latent frames into blocks of ``B`` and
``ar_step=k`` starts block ``m`` ``k`` levels behind block ``m−1``, so at every step the blocks in flight
sit at staggered noise levels, each moves one level down, the cleanest leaves and a fresh one enters
(``ar_step=1`` is DualParal's queue). Every rank draws the same initial noise for the whole video
(paradiff agrees on it before the call): the shared pool. The pipeline's loop runs on every rank; paradiff
reads its schedule (``generate_timestep_matrix``, wrapped on the instance during each call) and runs each
denoiser call as a pipeline of stages over frame blocks (``paradiff.stages.frame_block_hooks``):

* the transformer's blocks are cut into one contiguous stage per rank, and each rank keeps only its
  stage's weights (as ``pipefusion``; ``unparallelize`` brings the others back);
* a call runs only the frame blocks in flight (whose prediction the scheduler uses), oldest first,
  each through every stage in turn, so stage ``s`` works on block ``m`` while stage ``s+1`` works on
  block ``m−1``; the last stage's prediction of the blocks in flight goes to every rank (the pipeline
  drains at the end of each call, since the scheduler runs between calls: with ``M`` blocks in flight
  each rank idles about ``(N−1)/(M+N−1)`` of a call);
* each self-attention of frame block ``m`` attends to its own tokens and to the keys and values of the
  last ``dualparal_context`` frames of block ``m−1`` at the same layer (the feature cache), instead of
  every earlier block as the model's block-causal mask would: no rank ever holds the whole video's
  tokens, only the blocks in flight and each layer's kept keys and values of their last frames (the
  pipeline's own latents of the whole video, a few channels per pixel, stay on every rank).

Displaced or fresh. Block ``m−1`` runs before block ``m`` on every stage, so its keys and values of this
step are at hand (fresh). With ``dualparal_displaced=True`` (default), after ``warmup_steps`` (but on the
steps the staleness guard refreshes, ``fidelity_floor_db``) a block reads those block ``m−1`` kept at the
previous step, as DualParal's feature cache does: then the oldest block in flight reads what its finished
predecessor kept on its last step in flight, and no call runs a finished block (fresh, each finished block
runs once more, on the call after it finished, to keep its final keys and values).

The one-device schedule it equals. Fresh (``dualparal_displaced=False``, or ``warmup_steps`` at least the
pipeline's loop length ``pipe.num_timesteps``), the output equals, within float round-off, the stock
pipeline run on one device with the same arguments and the model's block-causal mask narrowed to this
window: frame block ``m`` sees block ``m`` and the last ``dualparal_context`` frames of block ``m−1``.
:func:`one_device_schedule` installs exactly that on one device. For a video of at most two frame blocks
with the whole previous block as context (``dualparal_context=None``), that window is the model's own mask,
and the output is the stock pipeline's.

Not run: ``addnoise_condition > 0`` (it re-noises the finished history frames at every step, so their keys
and values never settle), a model whose causal block is one frame (the pipeline was called without
``causal_block_size > 1``; the model then attends over all frames), and SkyReels-V2's pipelines without
per-frame noise levels.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat import CallContextHook
from ..errors import ParadiffError
from ..layers.sdpa import SDPAHook
from ..models import Capability, DenoiserFamily, family_of
from ..models.base import bind_inputs
from ..runtime.comm import Communicator
from ..stages.blocks import PassThroughHook, stage_blocks
from ..stages.cut import cut_by_bytes
from ..stages.frame_block_hooks import (
    BlockCursor,
    BlockPass,
    RotaryOffsetHook,
    StageEntryHook,
    TailKV,
    TailKVHook,
    WindowHook,
)
from ..stages.link import StageLink
from ..stages.load_stage import loaded_cut
from ..stages.release import check_releasable, release_other_stages
from .base import Strategy, StrategyOptions, is_count
from .costing import CostMachine, CostSetting, PassCost
from .installation import Installation
from .pipefusion import PipeFusionInstallation

#: What to use instead, named by refusals of pipelines without per-frame noise levels.
DIFFUSION_FORCING = (
    "diffusers' SkyReelsV2DiffusionForcingPipeline (SkyReelsV2Transformer3DModel, called with causal_block_size > 1 "
    "and ar_step >= 1)"
)


@dataclass(frozen=True)
class DualParalOptions(StrategyOptions):
    """
    Attributes:
        dualparal_context: latent frames at the end of frame block ``m−1`` whose keys and values block ``m``
            attends to, at most the block's frames (``causal_block_size``); ``None`` (default): all of them.
        dualparal_displaced: after ``warmup_steps``, read block ``m−1``'s keys and values of the previous step
            (DualParal's feature cache; no finished block is run again) instead of this step's (exact against
            :func:`one_device_schedule`).
    """

    dualparal_context: int | None = None
    dualparal_displaced: bool = True

    def __post_init__(self):
        if self.dualparal_context is not None and not is_count(self.dualparal_context, 1):
            raise ParadiffError(
                f"dualparal_context must be None or a number of latent frames >= 1, got {self.dualparal_context!r}"
            )
        if not isinstance(self.dualparal_displaced, bool):
            raise ParadiffError(f"dualparal_displaced must be True or False, got {self.dualparal_displaced!r}")


class DualParalStrategy(Strategy):
    name = "dualparal"
    refreshes = "per call"
    call_split = "pieces"
    Options = DualParalOptions
    needs = (Capability.FRAME_BLOCKS,)
    refusal_hint = f"; use {DIFFUSION_FORCING}"
    follows_model_changes = False

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> PassCost:
        """Each call runs one pass of a frame block per block in flight (fresh: one more per block just finished)
        through 1/N of the blocks, in passes + N − 1 slots; the embeddings and head run per pass on every rank;
        each pass's hidden states go to the next stage, and the last stage sends the prediction of the blocks in
        flight to every rank. ``m`` is the window's call; the passes are costed on one block pass's traced call
        (``setting.blocks.block``), of which ``setting.blocks.fraction``."""
        loop = setting.blocks
        if loop is None:
            raise ValueError("no cost model for strategy 'dualparal' without its block loop")
        b, groups = m.for_workload(loop.block), m.groups
        w, f = b.w, loop.fraction
        stage = b.compute(w.stack_flops * f / groups / n, calls=1 / n)
        outside = b.compute((w.flops - w.stack_flops) * f / groups, calls=0)  # embeddings and head, every pass
        hidden = max(w.unit_output_bytes, default=0.0) * f / groups
        prediction = w.latent_bytes * f / groups * (n - 1)

        def iteration(flight: int, done: int) -> tuple[float, float]:
            passes = flight + done
            compute = (passes + n - 1) * stage + passes * outside
            nbytes = max(passes * hidden, flight * prediction)  # a stage's hidden states; the last one's predictions
            return b.displaced(compute, b.transfer(nbytes, 2 * b.calls * passes)), nbytes

        fresh = tuple(iteration(flight, done) for flight, done in zip(loop.in_flight, loop.finished, strict=True))
        displaced = tuple(iteration(flight, 0) for flight in loop.in_flight)
        weights = (m.w.params - m.w.stack_params + m.w.stack_params / n) * m.w.itemsize
        return PassCost(fresh, displaced, loop.position, weights)

    @classmethod
    def predicted_exact(cls, synced: int, iterations: int, blocks) -> bool:
        """Fresh in every window, it equals one device when blocks see their predecessor only."""
        return blocks is not None and max(blocks.position) < synced and blocks.blocks <= 2

    @classmethod
    def plan_refusal(cls, forcing: bool, block_loop: bool) -> str | None:
        return None if block_loop else "the call schedules no frame blocks (--call causal_block_size=N with N > 1)"

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config) -> None:
        """Refuse, before any collective, a model without per-frame noise levels or with fewer blocks than stages."""
        super().check_model(denoiser, family, degree, config)
        name = type(denoiser).__name__
        blocks = family.frame_blocks
        check_releasable(stage_blocks(denoiser, blocks.stack), cls.name)
        count = len(stage_blocks(denoiser, blocks.stack))
        if count < degree:
            raise ParadiffError(
                f"strategy='dualparal' gives each of its {degree} stages (one per rank) at least one transformer "
                f"block, but this {name} has {count}; run it on at most {count} ranks (per CFG half with "
                "cfg_parallel)"
            )
        frames_per_token = family.frames_per_token(denoiser)
        if frames_per_token != 1:
            raise ParadiffError(
                f"strategy='dualparal' cuts the latent frames into blocks, but this {name} patches "
                f"{frames_per_token} frames into one token; use strategy='parastep' or 'cfg'"
            )

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> DualParalInstallation:
        """Keep this rank's stage of the blocks, free the others', hook the denoiser to run frame blocks through it."""
        description = family.frame_blocks
        stack = description.stack
        named = stage_blocks(denoiser, stack)
        blocks = [block for _, block in named]
        cut = loaded_cut(denoiser, comm.rank) or cut_by_bytes(blocks, comm.size)
        first = sum(cut[: comm.rank])
        mine = range(first, first + cut[comm.rank])
        cursor = BlockCursor()
        schedule = FrameSchedule(family, comm, self.options)
        installed = DualParalInstallation(denoiser, self.name, comm, blocks, cut, schedule)
        window = WindowHook(family.latent_arg, family.timestep_arg, cursor, schedule.plan, schedule.finish)
        installed.hook(denoiser, window)
        installed.hook(denoiser.get_submodule(description.rotary), RotaryOffsetHook(cursor, family.rotary_at))
        block_hooks = {i: PassThroughHook(stack) for i in range(len(blocks)) if i != first}

        def stage_forwards() -> list:  # the blocks' own forwards, beneath the hooks registered below
            return [block_hooks[i].fn_ref.original_forward for i in mine]

        block_hooks[first] = StageEntryHook(stack, cursor, stage_forwards)
        for index, block in enumerate(blocks):
            installed.hook(block, block_hooks[index])
        for i in mine:
            name = f"{named[i][0]}.{description.self_attention}"
            installed.hook(denoiser.get_submodule(name), TailKVHook(name, cursor))
        installed.released = release_other_stages(denoiser, blocks, cut, comm.rank)
        installed.on_remove(installed.restore)
        return installed.done()


class DualParalInstallation(PipeFusionInstallation):
    """Also reads the pipeline's block schedule during each call (:meth:`steer`)."""

    def __init__(self, model, strategy, comm, blocks, cut, schedule: FrameSchedule):
        super().__init__(model, strategy, comm, blocks, cut)
        self.schedule = schedule

    def steer(self, pipe):
        """Read the pipeline's block schedules during one ``pipe(...)`` call (:func:`block_schedules`)."""
        self.schedule.begin_run()
        return block_schedules(pipe, functools.partial(self.schedule.read, pipe))


def makes_block_schedules(pipe) -> bool:
    """Whether ``pipe`` is a diffusion-forcing pipeline: one that makes its own schedule of frame blocks."""
    return callable(getattr(pipe, "generate_timestep_matrix", None))


@contextlib.contextmanager
def block_schedules(pipe, read: Callable[[dict, tuple], None]):
    """Around ``pipe(...)``: ``read(arguments, matrices)`` for each block schedule the pipeline makes.

    A diffusion-forcing pipeline makes its schedule with ``generate_timestep_matrix`` (one per window of a long
    video); it is wrapped on this instance only, and the arguments are bound by name, defaults applied.
    """
    if not makes_block_schedules(pipe):
        yield
        return
    stock = pipe.generate_timestep_matrix
    shadowed = vars(pipe).get("generate_timestep_matrix")  # a wrapper someone else put on the instance
    signature = inspect.signature(stock)

    def recording(*args, **kwargs):
        matrices = stock(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        read(arguments.arguments, matrices)
        return matrices

    pipe.generate_timestep_matrix = functools.update_wrapper(recording, stock)
    try:
        yield
    finally:
        if shadowed is None:
            del pipe.generate_timestep_matrix
        else:
            pipe.generate_timestep_matrix = shadowed


@dataclass
class _ContextRun:
    """One call context's progress through the current schedule (``"cond"`` and ``"uncond"`` keep apart)."""

    link: StageLink
    iteration: int = 0
    #: Kept keys and values by block, from the previous call and from this one.
    previous: dict[int, dict[str, TailKV]] = field(default_factory=dict)
    now: dict[int, dict[str, TailKV]] = field(default_factory=dict)
    #: The latest finished block whose final keys and values are kept, and them.
    finished: tuple[int, dict[str, TailKV]] | None = None


class FrameSchedule:
    """Which frame blocks each denoiser call runs and which kept keys and values each block reads.

    It reads the pipeline's schedule as the pipeline makes it: per iteration, each frame's level
    (0: not started; ``steps + 1``: finished) and whether the scheduler updates it (in flight).
    """

    def __init__(self, family: DenoiserFamily, comm: Communicator, options: DualParalOptions):
        self.family, self.comm, self.options = family, comm, options
        self.levels: torch.Tensor | None = None
        self.updated: torch.Tensor | None = None
        self.finished_level = 0
        self.contexts: dict[str, _ContextRun] = {}

    def begin_run(self) -> None:
        """A ``pipe(...)`` call starts: nothing of an earlier call is read."""
        self.levels = self.updated = None
        self.contexts.clear()

    def read(self, pipe, arguments: dict, matrices) -> None:
        """The schedule the pipeline just made (a long video makes one per window): check it, start over."""
        frames, block = arguments["num_latent_frames"], arguments["causal_block_size"]
        if block > 1 and frames % block:
            temporal = getattr(pipe, "vae_scale_factor_temporal", 4)
            lower, upper = frames - frames % block, frames - frames % block + block
            videos = " or ".join(str((n - 1) * temporal + 1) for n in (lower, upper) if n > 0)
            raise ParadiffError(
                f"strategy='dualparal' cuts the {frames} latent frames into blocks of causal_block_size={block}, which "
                f"does not divide them; use num_frames={videos} (a multiple of {block} latent frames), or a "
                "causal_block_size that divides them"
            )
        _, self.levels, self.updated, _ = matrices
        self.finished_level = len(arguments["step_template"]) + 1
        self.contexts.clear()

    def _context(self, name: str) -> _ContextRun:
        if name not in self.contexts:
            self.contexts[name] = _ContextRun(StageLink(self.comm))
        return self.contexts[name]

    def plan(self, model: nn.Module, inputs: dict, context: str | None):
        """``(passes, frames per block, predicted frames (first, stop), stage link)`` of this call."""
        family = self.family
        forcing = family.frame_blocks.forcing_arg
        if self.levels is None or not inputs.get(forcing):
            raise ParadiffError(
                f"strategy='dualparal' runs the denoiser inside a diffusion-forcing pipeline's call, with one noise "
                f"level per frame ({forcing}=True); this call has none: use {DIFFUSION_FORCING}"
            )
        block = family.causal_block_frames(model)
        if block == 1:
            raise ParadiffError(
                "strategy='dualparal' runs the model's causal blocks of frames through its stages, but this call's "
                f"model attends over all frames at once; pass causal_block_size > 1 (e.g. {DIFFUSION_FORCING})"
            )
        context_frames = self.options.dualparal_context or block
        if context_frames > block:
            raise ParadiffError(
                f"dualparal_context={context_frames} frames is more than a frame block (causal_block_size={block}); "
                f"use dualparal_context <= {block}, or a larger causal_block_size"
            )
        run = self._context(context or "default")
        latent, timestep = inputs[family.latent_arg], inputs[family.timestep_arg]
        self.comm.state.enter_call(context, timestep)
        levels, updated = self.levels[run.iteration], self.updated[run.iteration]
        displaced = self.options.dualparal_displaced and not self.comm.state.synchronous  # warm-up, or refreshed
        run.iteration += 1
        frames = latent.shape[2]
        if levels.numel() != frames:
            raise ParadiffError(
                f"strategy='dualparal' reads the pipeline's schedule of {levels.numel()} frames, but the denoiser got "
                f"{frames}; use {DIFFUSION_FORCING} with base_num_frames >= num_frames or overlap_history set"
            )
        in_flight = [m for m in range(frames // block) if bool(updated[m * block])]
        finished = [m for m in range(frames // block) if int(levels[m * block]) >= self.finished_level]
        self._check_history(timestep, finished, block)
        tail_tokens = context_frames * family.tokens_per_frame(model, latent)
        passes = self._passes(run, in_flight, finished, displaced, block, tail_tokens)
        link = run.link
        link.begin_call(len(passes))
        if not link.first:
            width = model.config.num_attention_heads * model.config.attention_head_dim
            shape = (latent.shape[0], block * family.tokens_per_frame(model, latent), width)
            link.expect(len(passes), shape, model.patch_embedding.weight)
        return passes, block, (in_flight[0] * block, (in_flight[-1] + 1) * block), link

    def _check_history(self, timestep: torch.Tensor, finished: list[int], block: int) -> None:
        for m in finished:
            if bool((timestep[:, m * block : (m + 1) * block] != 0).any()):
                raise ParadiffError(
                    "strategy='dualparal' keeps finished frames fixed, but this call re-noises them "
                    "(addnoise_condition > 0); call the pipeline with addnoise_condition=0"
                )

    def _passes(self, run: _ContextRun, in_flight, finished, displaced: bool, block: int, tail_tokens: int):
        """The call's block passes: finished blocks whose final kept keys and values are missing, then those in flight.

        A finished block runs only when the oldest block in flight must read its final keys and values (fresh)
        and no call has kept them yet; its own predecessor's must then be kept, or run too, back to the first
        block of the window.
        """
        oldest = in_flight[0]
        before = oldest - 1
        kept = run.finished[0] if run.finished else -1
        catch_up = []
        if before >= 0 and kept != before and not (displaced and before in run.previous):
            catch_up = list(range(kept + 1, before + 1))
        if any(m not in finished for m in catch_up):
            raise ParadiffError(
                "strategy='dualparal' found a frame block behind the oldest block in flight that has not finished; "
                f"the pipeline's schedule is not block-causal: use {DIFFUSION_FORCING}"
            )
        run.now = {}
        passes = []
        for index, m in enumerate([*catch_up, *in_flight]):
            passes.append(BlockPass(index, m, m * block, tail_tokens, self._reads(run, m - 1, displaced)))
            run.now[m] = passes[-1].keeps
        if catch_up:  # filled as the pass runs
            run.finished = (catch_up[-1], run.now[catch_up[-1]])
        return passes

    @staticmethod
    def _reads(run: _ContextRun, before: int, displaced: bool) -> dict[str, TailKV] | None:
        """The kept keys and values block ``before + 1`` reads (None for the window's first block)."""
        if before < 0:
            return None
        if displaced and before in run.previous:
            return run.previous[before]
        if before in run.now:
            return run.now[before]
        if run.finished and run.finished[0] == before:
            return run.finished[1]
        raise ParadiffError(f"strategy='dualparal' holds no keys and values of frame block {before}")

    def finish(self, context: str | None) -> None:
        """The call's blocks have run: what they kept is the previous step's for the next call."""
        run = self._context(context or "default")
        run.previous, run.now = run.now, {}


@contextlib.contextmanager
def one_device_schedule(pipe, dualparal_context: int | None = None):
    """On one device, inside the block: ``pipe(...)`` computes what ``dualparal`` computes fresh.

    ``pipe`` is a diffusion-forcing pipeline, not parallelized. Its stock loop runs unchanged; only every
    self-attention's block-causal mask is narrowed to dualparal's window (frame block ``m`` sees block ``m``
    and the last ``dualparal_context`` frames of block ``m−1``; None: all of block ``m−1``). Every frame of
    the window still runs at every step, as the stock pipeline runs them: it is the reference, not a saving.
    """
    model = pipe.transformer
    family = family_of(model)
    blocks = family.frame_blocks
    if blocks is None:
        raise ParadiffError(f"one_device_schedule runs {DIFFUSION_FORCING}, not {type(model).__name__}")
    installed = Installation(model, "dualparal-reference")
    shape = _WindowShape(family)
    installed.hook(model, shape)
    for name, _ in stage_blocks(model, blocks.stack):
        attention = f"{name}.{blocks.self_attention}"
        installed.hook(model.get_submodule(attention), _WindowMask(attention, shape, dualparal_context))
    installed.done()
    try:
        yield pipe
    finally:
        installed.remove()


class _WindowShape(CallContextHook):
    """On the denoiser: the call's frames, tokens per frame and frames per causal block, for the masks."""

    def __init__(self, family: DenoiserFamily):
        super().__init__()
        self.family = family
        self.frames = self.tokens = self.block = 0

    def pre_forward(self, module, *args, **kwargs):
        latent = bind_inputs(module, args, kwargs).arguments[self.family.latent_arg]
        self.frames, self.tokens = latent.shape[2], self.family.tokens_per_frame(module, latent)
        self.block = self.family.causal_block_frames(module)
        if self.block == 1:
            raise ParadiffError("one_device_schedule needs the model's causal frame blocks: pass causal_block_size > 1")
        return args, kwargs


class _WindowMask(SDPAHook):
    """On one self-attention: the model's block-causal mask replaced by dualparal's window."""

    def __init__(self, name: str, shape: _WindowShape, context: int | None):
        super().__init__(name)
        self.shape, self.context = shape, context

    def attend(self, call, query, key, value, options):
        shape = self.shape
        frame = torch.arange(shape.frames * shape.tokens, device=query.device) // shape.tokens
        block = frame // shape.block
        first_seen = block * shape.block - (self.context or shape.block)  # of the previous block, per query
        same = block[:, None] == block[None, :]
        tail = (block[None, :] == block[:, None] - 1) & (frame[None, :] >= first_seen[:, None])
        options["attn_mask"] = (same | tail)[None, None]
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **options)
