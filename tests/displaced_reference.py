"""Single-process references of the displaced strategies: what "stale by one step" means, written out.

Each ``*_reference(pipe, call, ...)`` runs ``pipe(**call)`` once in this process, on a pipeline paradiff
has not touched, and returns what the pipeline returns. The denoiser is run several times per step
(once per band, patch, virtual rank or component) with plain torch hooks that feed each layer or unit
the values the strategy's definition says it sees. Nothing of paradiff's strategies, layers or runtime
is used (only ``paradiff.models.family_of`` to list the self-attention layers), so an off-by-one in their
staleness makes the multi-rank result differ from these.

Steps are counted from 0, one denoiser call per step (true for the CFG-batched pipelines the tests use).
Steps ``0..warmup_steps`` are exact everywhere, and so are the steps in ``refreshed`` (those a staleness guard
refreshes); "step t−1" below is the previous denoiser call, whether it was exact or displaced.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from paradiff.models import family_of


def denoiser_of(pipe) -> nn.Module:
    return getattr(pipe, "unet", None) or pipe.transformer


def _span(length: int, index: int, parts: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``length`` entries cut into ``parts`` equal parts."""
    if length % parts:
        raise ValueError(f"{length} rows do not split into {parts} equal parts")
    size = length // parts
    return index * size, size


def _part(tensor: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    return tensor.narrow(dim, *_span(tensor.shape[dim], index, parts))


def _sample(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_sample(output, sample: torch.Tensor):
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output.sample = sample
    return output


def _grid_rows(sample: torch.Tensor) -> torch.Tensor:
    """A denoiser output with its token grid's rows along the second-to-last dim: a video's ``(batch, channels,
    frames, rows, cols)`` as ``(batch, channels, frames × rows, cols)`` (frames then rows, as its tokens run)."""
    return sample.flatten(2, 3) if sample.ndim == 5 else sample


def _rows_dim(sample: torch.Tensor) -> int:
    """The latent rows of a denoiser output ``(batch, channels, [frames,] rows, cols)``."""
    return sample.ndim - 2


@contextlib.contextmanager
def _denoiser_forward(model: nn.Module, forward: Callable):
    """Inside the block ``model(...)`` runs ``forward(stock_forward, *args, **kwargs)``, once per step."""
    model.forward = functools.partial(forward, model.forward)
    try:
        yield
    finally:
        del model.forward


@contextlib.contextmanager
def _hooks(handles: list):
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _self_attention_kv(model: nn.Module) -> list[nn.Module]:
    """The key and value projections of every attention layer that mixes image tokens."""
    return [proj for _, attn in family_of(model).self_attention(model) for proj in (attn.to_k, attn.to_v)]


def patch_reference(pipe, call: dict, ranks: int, warmup_steps: int, refreshed: frozenset[int] = frozenset()):
    """DistriFusion (``patch``) on ``ranks`` row bands, one band at a time.

    A displaced step t runs the whole model once per band i. Every layer that mixes rows sees band i's
    rows as band i computes them now and every other band's rows as *that band* computed them at step
    t−1 (in its own pass of step t−1, itself displaced after warm-up):

    * 2-D convolutions whose kernel reaches past their stride (3×3, strided 3×3; ``conv_in`` too, so
      its halo is the previous step's latent): their input rows;
    * GroupNorm: its input rows, so the statistics are the whole image's with the other bands' part
      one step old;
    * self-attention: the keys and values of the other bands' tokens.

    Per-token layers, cross-attention and a patchifying convolution never read another band's rows.
    The step's output is band i's rows of pass i, for every i. A warm-up step is one exact pass that
    records every layer's values for the next step.
    """
    model = denoiser_of(pipe)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size[0] > m.stride[0]]
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    step = 0
    band: int | None = None  # the band of the current pass; None: an exact pass
    previous: dict[nn.Module, torch.Tensor] = {}  # each layer's rows of step t−1, band by band
    current: dict[nn.Module, torch.Tensor] = {}

    def displaced(layer: nn.Module, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if band is None:
            current[layer] = tensor.detach().clone()
            return tensor
        own = _part(tensor, dim, band, ranks)
        current.setdefault(layer, torch.empty_like(tensor))
        _part(current[layer], dim, band, ranks).copy_(own)
        mixed = previous[layer].clone()
        _part(mixed, dim, band, ranks).copy_(own)
        return mixed

    def on_input(layer, args):  # rows: the second-to-last dim (also of a video U-Net's 5-D GroupNorm input)
        return (displaced(layer, args[0], args[0].ndim - 2), *args[1:])

    def on_output(layer, args, output):
        return displaced(layer, output, 1)

    def forward(stock, *args, **kwargs):
        nonlocal step, band, previous, current
        current = {}
        if step <= warmup_steps or step in refreshed:
            band = None
            output = stock(*args, **kwargs)
        else:
            bands = []
            for band in range(ranks):  # the hooks read `band`
                output = stock(*args, **kwargs)
                sample = _sample(output)
                bands.append(_part(sample, _rows_dim(sample), band, ranks))
            output = _with_sample(output, torch.cat(bands, _rows_dim(sample)))
        step, previous = step + 1, current
        return output

    handles = [m.register_forward_pre_hook(on_input) for m in convs + norms]
    handles += [m.register_forward_hook(on_output) for m in _self_attention_kv(model)]
    with _hooks(handles), _denoiser_forward(model, forward):
        return pipe(**call)


def pipefusion_reference(
    pipe,
    call: dict,
    patches: int,
    warmup_steps: int,
    calls: int = 1,
    ahead=None,
    refreshed: frozenset[int] = frozenset(),
):
    """PipeFusion (``pipefusion``) with ``patches`` patches of whole token rows, one patch at a time.

    A displaced step t runs the whole model once per patch m = 0..M−1, in order. Each self-attention
    layer keeps one buffer of the whole image's keys and values per call of the step (``calls``: two for
    a CFG run as two calls): pass m writes patch m's slice and attends to the whole buffer, so patches < m
    hold this step's values, patch m its own and patches > m those of step t−1 (their pass of step t−1).
    The step's output is patch m's rows of pass m, for every m. A warm-up step is one exact pass that
    fills the buffers. How the blocks are cut into stages does not matter: every patch goes through every
    block in order. ``ahead`` (:class:`FlowingAhead`) gives some passes another model input.
    """
    model = denoiser_of(pipe)
    calls_done = 0
    patch: int | None = None  # the patch of the current pass; None: an exact pass
    slot = 0  # the call of the step
    buffers: dict[tuple[nn.Module, int], torch.Tensor] = {}

    def on_output(layer, args, output):
        if patch is None:
            buffers[(layer, slot)] = output.detach().clone()
            return output
        buffer = buffers[(layer, slot)]
        _part(buffer, 1, patch, patches).copy_(_part(output, 1, patch, patches))
        return buffer.clone()

    def forward(stock, *args, **kwargs):
        nonlocal calls_done, patch, slot
        index, calls_done = calls_done, calls_done + 1
        slot = index % calls
        if index // calls <= warmup_steps or index // calls in refreshed:
            patch = None
            output = stock(*args, **kwargs)
            if ahead is not None:
                ahead.finished(slot, _sample(output))
            return output
        bound = inspect.signature(stock).bind(*args, **kwargs)
        rows = []
        for patch in range(patches):  # the hooks read `patch`
            real = bound.arguments["hidden_states"]
            if ahead is not None:
                bound.arguments["hidden_states"] = ahead.input(slot, patch, real)
            output = stock(*bound.args, **bound.kwargs)
            bound.arguments["hidden_states"] = real
            sample = _sample(output)
            grid = _grid_rows(sample)
            rows.append(_part(grid, grid.ndim - 2, patch, patches))
            if ahead is not None:
                zeros = [torch.zeros_like(rows[0])] * (patches - len(rows))
                ahead.patch_done(slot, patch, torch.cat(rows + zeros, grid.ndim - 2).view(sample.shape))
        output = _with_sample(output, torch.cat(rows, grid.ndim - 2).view(sample.shape))
        if ahead is not None:
            ahead.finished(slot, _sample(output))
        return output

    handles = [m.register_forward_hook(on_output) for m in _self_attention_kv(model)]
    with _hooks(handles), _denoiser_forward(model, forward):
        return pipe(**call)


class FlowingAhead:
    """What flowing changes in :func:`pipefusion_reference`: the model input of the first ``stages − 1`` patches of a
    step that follows a displaced one, worked out before the pipeline passed it.

    Stage 0 starts patch p < N−1 of the next step as soon as the last stage has finished patch p of this one,
    so those patches run on what the pipeline's loop *will* pass, worked out from this step's output at the
    rows of patches 0..p (zeros elsewhere): the CFG combination ``u + g·(c − u)`` of the batch halves
    (``calls=1``) or of the step's two calls, cond first (``calls=2``), the first half of the channels for a
    model that also predicts its variance, one step of a copy of the scheduler from the latent the pipeline
    holds, and the model input made from that (repeated for a batched CFG, through ``scale_model_input`` if
    ``scaled``). A step's second call gets the step's latent, which it had anyway. Each layer's buffer sees
    the patches in the same order as when the pipeline drains, so flowing equals draining bit for bit when
    the work ahead is right.
    """

    def __init__(self, pipe, stages: int, guidance: float, calls: int = 1, scaled: bool = False):
        self.pipe, self.stages, self.guidance, self.calls, self.scaled = pipe, stages, guidance, calls, scaled
        self.steps_done = 0
        self.latent, self.arguments = None, ((), {})
        self.cond: torch.Tensor | None = None
        self.worked_out: dict[int, torch.Tensor] = {}
        self.coming: dict[int, torch.Tensor] = {}

    def input(self, slot: int, patch: int, real: torch.Tensor) -> torch.Tensor:
        return self.worked_out.get(patch, real) if slot == 0 else real

    def patch_done(self, slot: int, patch: int, partial: torch.Tensor) -> None:
        scheduler = self.pipe.scheduler
        if slot == self.calls - 1 and patch < self.stages - 1 and self.steps_done + 1 < len(scheduler.timesteps):
            self.coming[patch] = self.work_ahead(partial)

    def finished(self, slot: int, output: torch.Tensor) -> None:
        if slot < self.calls - 1:
            self.cond = output
        else:  # the next step's first call reads what this one worked out
            self.worked_out, self.coming = self.coming, {}

    def work_ahead(self, partial: torch.Tensor) -> torch.Tensor:
        model, scheduler = denoiser_of(self.pipe), self.pipe.scheduler
        uncond, cond = partial.chunk(2) if self.calls == 1 else (partial, self.cond)
        prediction = uncond + self.guidance * (cond - uncond)
        if model.config.out_channels == 2 * model.config.in_channels:
            prediction = prediction.chunk(2, dim=1)[0]
        copy = _scheduler_copy(scheduler)
        args, kwargs = self.arguments
        timesteps = copy.timesteps
        latent = type(scheduler).step(copy, prediction, timesteps[self.steps_done], self.latent, *args, **kwargs)[0]
        latent = torch.cat([latent] * 2) if self.calls == 1 else latent
        return copy.scale_model_input(latent, timesteps[self.steps_done + 1]) if self.scaled else latent

    def run(self, call: dict, patches: int, warmup_steps: int):
        """The pipeline's call under :func:`pipefusion_reference` with this work ahead."""
        scheduler = self.pipe.scheduler
        stock_step = type(scheduler).step

        def step(model_output, timestep, sample, *args, **kwargs):
            output = stock_step(scheduler, model_output, timestep, sample, *args, **kwargs)
            self.latent, self.arguments = output[0], (args, kwargs)
            self.steps_done += 1
            return output

        scheduler.step = step
        try:
            return pipefusion_reference(self.pipe, call, patches, warmup_steps, self.calls, self)
        finally:
            del scheduler.step


def pipefusion_flowing_reference(pipe, call: dict, patches: int, warmup_steps: int, stages: int, **forms):
    """PipeFusion's flowing pipeline of ``stages`` stages: :func:`pipefusion_reference` with :class:`FlowingAhead`
    (``forms``: its ``guidance``, ``calls``, ``scaled``)."""
    return FlowingAhead(pipe, stages, **forms).run(call, patches, warmup_steps)


def _scheduler_copy(scheduler):
    """An independent scheduler in the same state (without the instance's wrapped ``step``)."""
    clone = object.__new__(type(scheduler))
    clone.__dict__ = copy.deepcopy({k: v for k, v in vars(scheduler).items() if k != "step"})
    return clone


def parastep_reference(pipe, call: dict, ranks: int, warmup_steps: int, refreshed: frozenset[int] = frozenset()):
    """ParaStep (``parastep``) on ``ranks`` virtual ranks, simulated one after the other.

    Every virtual rank caches the (CFG-combined) prediction of its last model run; warm-up steps run
    the model everywhere. After warm-up, rounds of ``ranks`` steps (the last one may be shorter) start
    from one latent and scheduler state. Virtual rank k copies both, advances them through round
    positions 0..k−1 with its cached prediction, and runs the model at position k on that speculative
    latent (its new cache). Virtual rank 0 applies, at each position k, rank k's fresh prediction to its
    own latent and scheduler; they start the next round. "Stale" here: rank k's speculative steps use
    the prediction it made at position k of the previous round (or the last warm-up step).

    The pipeline's own loop runs the model: ``scheduler.step`` is wrapped so that the latent it hands
    back is the one the next model run needs (rank k+1's speculative latent, or rank 0's at the end of
    a round). The pipeline's scheduler holds rank 0's state throughout; ``scale_model_input`` reads only
    the step index, which every rank shares.
    """
    scheduler = pipe.scheduler
    stock = type(scheduler).step
    total = call["num_inference_steps"]
    steps_done = 0
    cache: list[torch.Tensor | None] = [None] * ranks  # each virtual rank's last prediction
    round_state: dict = {}

    def step(model_output, timestep, sample, *args, **kwargs):
        nonlocal steps_done
        index, steps_done = steps_done, steps_done + 1
        if index <= warmup_steps or index in refreshed:
            cache[:] = [model_output] * ranks
            return stock(scheduler, model_output, timestep, sample, *args, **kwargs)
        last_exact = max([warmup_steps, *(done for done in refreshed if done < index)])
        position = (index - last_exact - 1) % ranks
        if position == 0:
            round_state.update(
                start=sample, scheduler=_scheduler_copy(scheduler), length=min(ranks, total - index), timesteps=[]
            )
            round_state["latent"] = sample
        round_state["timesteps"].append(timestep)
        cache[position] = model_output  # the model just ran on virtual rank `position`'s latent
        output = stock(scheduler, model_output, timestep, round_state["latent"], *args, **kwargs)
        round_state["latent"] = output[0]
        following = position + 1
        if following == round_state["length"]:
            return output
        speculative, latent = _scheduler_copy(round_state["scheduler"]), round_state["start"]
        for t in round_state["timesteps"]:
            latent = stock(speculative, cache[following], t, latent, *args, **kwargs)[0]
        return (latent, *output[1:])

    scheduler.step = step
    try:
        return pipe(**call)
    finally:
        del scheduler.step


def model_units(model: nn.Module) -> list[nn.Module]:
    """The chain of units a component cut counts: a U-Net's down, mid and up blocks; a DiT's blocks."""
    if hasattr(model, "down_blocks"):
        return [*model.down_blocks, model.mid_block, *model.up_blocks]
    return list(model.transformer_blocks)


def asyncdiff_reference(
    pipe, call: dict, cut: tuple[int, ...], warmup_steps: int, stride: int = 1, refreshed: frozenset[int] = frozenset()
):
    """AsyncDiff (``asyncdiff``) with components of ``cut`` units, one model pass per (virtual) rank.

    Stride 1: at a displaced step t, component n runs its own units fresh on step t's inputs, while
    every unit of an earlier component (its predecessor's last unit, U-Net skip features) yields the
    output its owner computed at step t−1. The embeddings and the head run fresh; the prediction is
    the last component's pass.

    Stride 2 (``len(cut) + 1`` ranks): displaced steps pair up. On a pair's first step t, ranks
    0..N−1 run component n at the extrapolated next timestep ``2·t − t_prev`` (t_prev: the previous
    step's timestep argument), and an extra rank runs the last component at t; the earlier units
    yield what ranks 0..N−1 computed on the previous pair's first step (the last warm-up step for the
    first pair). The extra rank's output is step t's prediction, the last component's look-ahead
    output that of step t+1, whose model call computes nothing.
    """
    model = denoiser_of(pipe)
    units = model_units(model)
    owner = [component for component, count in enumerate(cut) for _ in range(count)]
    if len(owner) != len(units):
        raise ValueError(f"cut {cut} covers {len(owner)} units, the model has {len(units)}")
    signature = inspect.signature(type(model).forward)
    steps_done = 0
    component: int | None = None  # the component of the current pass; None: an exact pass
    recording = True  # whether this pass's outputs of its own units are the ones later passes read
    previous: dict[int, object] = {}  # each unit's output as its owner last computed it
    current: dict[int, object] = {}
    ahead = None  # stride 2: the look-ahead prediction for the next step
    last_timestep = None

    def on_unit(index: int):
        def hook(module, args, output):
            if component is not None and owner[index] < component:
                return previous[index]
            if recording and (component is None or owner[index] == component):
                current[index] = output
            return output

        return hook

    def run(stock, args, kwargs, which: int | None, record: bool = True, timestep=None):
        nonlocal component, recording
        component, recording = which, record
        if timestep is None:
            return stock(*args, **kwargs)
        bound = signature.bind(model, *args, **kwargs)
        bound.arguments["timestep"] = timestep
        return stock(*bound.args[1:], **bound.kwargs)

    def forward(stock, *args, **kwargs):
        nonlocal steps_done, previous, current, ahead, last_timestep
        step, steps_done = steps_done, steps_done + 1
        last_exact = max([warmup_steps, *(done for done in refreshed if done < step)])
        displaced = -1 if step in refreshed else step - last_exact - 1  # displaced steps since the last exact one
        timestep = signature.bind(model, *args, **kwargs).arguments["timestep"]
        before, last_timestep = last_timestep, timestep
        if displaced >= 0 and displaced % stride:  # stride 2, a pair's second step: computes nothing
            return ahead
        current = {}
        if displaced < 0:
            output = run(stock, args, kwargs, None)
        elif stride == 1:
            for n in range(len(cut)):
                output = run(stock, args, kwargs, n)
        else:
            for n in range(len(cut)):
                output = run(stock, args, kwargs, n, timestep=timestep + (timestep - before))
            ahead = _with_sample(output, _sample(output).clone())
            output = run(stock, args, kwargs, len(cut) - 1, record=False)
        previous = current
        return output

    handles = [unit.register_forward_hook(on_unit(index)) for index, unit in enumerate(units)]
    with _hooks(handles), _denoiser_forward(model, forward):
        return pipe(**call)
