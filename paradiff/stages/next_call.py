"""The pipeline's next denoiser call, worked out before the pipeline makes it (``pipefusion``'s flowing pipeline).

Between two denoiser calls the pipeline's own loop combines the CFG halves, steps its scheduler and makes
the next call's input from the new latent. Every stock pipeline computes each of these per position (per
latent pixel, or token), so the next call's input at the rows of a patch whose output is done exists as
soon as that patch is: this module reproduces the loop's work on such a partial output, without running
(or copying) the loop. It learns how the pipeline does each part by matching a few candidates bit for bit
against what the pipeline really did, at the first steps where it can see it:

* the guidance: what the pipeline hands ``scheduler.step`` from the step's denoiser outputs: the output
  itself, or ``u + g·(c − u)`` of the two halves of the batch (one call) or of two calls (true CFG, in
  ``cache_context("cond")`` / ``("uncond")`` or not), in the output's channels or their first half (a
  learned variance), before or after casting to the dtype ``step`` gets; ``g`` is fitted and taken as the
  float32 the product computes with;
* the step: a copy of the pipeline's scheduler in the state before the step, stepped with the arguments
  the pipeline gave the last step (a generator cloned, so that the pipeline's own draws are untouched);
* the input: the denoiser's latent argument from the scheduler's latent (repeated for a CFG batch, through
  ``scale_model_input`` or not, in the argument's dtype); its timestep argument from the scheduler's
  timestep (``t``, ``t / 1000`` or ``1000 − t``, cast before or after, in the argument's shape); every
  other argument as the same call of the previous step passed it.

The scheduler's ``step`` is observed, for the length of one ``pipe(...)`` call, through a wrapper on the
pipeline's scheduler instance (never its class). Each learned part is checked again at every step; one
that stops matching (a guidance scale that changes per step, a latent a callback edited) ends the
forecasts for the call, and :attr:`NextCall.refusal` says why. A forecast is never trusted on its own:
the stages that compute ahead compare what they computed with the call the pipeline then really makes.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Call:
    """One denoiser call of the current ``pipe(...)`` call: its cache context, arguments (by name) and output."""

    context: str | None
    arguments: dict
    output: torch.Tensor | None = None


@dataclass(frozen=True)
class Upcoming:
    """The call the pipeline makes next: its cache context, whether it starts a new step, and the call whose
    arguments it repeats (the same call of the previous step)."""

    context: str | None
    new_step: bool
    template: Call


@dataclass(frozen=True)
class Guidance:
    """How a step's denoiser outputs become the prediction ``scheduler.step`` gets."""

    #: "none" (one call, the prediction itself), "batch" (uncond and cond halves of one call's batch) or
    #: "calls" (cond, then uncond, in two calls).
    kind: str
    scale: float = 1.0
    #: Only the first half of the channels (a model that also predicts its variance).
    half_channels: bool = False
    #: The dtype to cast the outputs to before combining them; None: combine, then cast.
    cast_first: torch.dtype | None = None
    #: Each token's combination rescaled to the cond prediction's norm over the last dimension (Qwen-Image).
    rescaled: bool = False

    def __call__(self, outputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if self.cast_first is not None:
            outputs = [output.to(self.cast_first) for output in outputs]
        if self.kind == "none":
            combined = outputs[0]
        else:
            uncond, cond = outputs[0].chunk(2) if self.kind == "batch" else (outputs[1], outputs[0])
            combined = uncond + self.scale * (cond - uncond)
            if self.rescaled:
                combined = combined * (
                    torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
                )
        if self.half_channels:
            combined = combined.chunk(2, dim=1)[0]
        return combined.to(dtype)


@dataclass(frozen=True)
class InputForm:
    """How the denoiser's latent argument comes from the scheduler's latent."""

    repeats: int
    scaled: bool
    dtype: torch.dtype

    def __call__(self, latent: torch.Tensor, scheduler, timestep) -> torch.Tensor:
        sample = torch.cat([latent] * self.repeats) if self.repeats > 1 else latent
        if self.scaled:
            sample = scheduler.scale_model_input(sample, timestep)
        return sample.to(self.dtype)


#: The timestep arguments pipelines pass, from the scheduler's timestep ``t``.
TIMESTEP_FORMS: dict[str, Callable] = {
    "t": lambda t: t,
    "t / 1000": lambda t: t / 1000,
    "1000 - t": lambda t: 1000 - t,
}


@dataclass(frozen=True)
class TimestepForm:
    """How the denoiser's timestep argument comes from the scheduler's timestep."""

    form: str
    cast_first: bool
    like: torch.Tensor

    def __call__(self, timestep: torch.Tensor) -> torch.Tensor:
        value = torch.as_tensor(timestep, device=self.like.device).reshape(()).expand(self.like.shape)
        apply = TIMESTEP_FORMS[self.form]
        return apply(value.to(self.like.dtype)) if self.cast_first else apply(value).to(self.like.dtype)


class NextCall:
    """What one ``pipe(...)`` call's loop does between denoiser calls, learned and reproduced (see the module).

    The denoiser's side reports each call (:meth:`observe_call`, :meth:`observe_output`); the scheduler's
    ``step`` is wrapped by :meth:`watch`. :meth:`upcoming`, :meth:`arguments` and :meth:`latent_after`
    give the next call.
    """

    def __init__(self, scheduler, latent_arg: str, timestep_arg: str):
        self.scheduler = scheduler
        self.latent_arg, self.timestep_arg = latent_arg, timestep_arg
        #: The calls of the last finished step, and of the step in progress (the running call last).
        self.previous: list[Call] = []
        self.current: list[Call] = []
        #: The scheduler's latent after the last step, the timestep and further arguments that step had.
        self.latent: torch.Tensor | None = None
        self.timestep = None
        self.step_arguments: dict = {}
        self.guidance: Guidance | None = None
        self.input: InputForm | None = None
        self.time: TimestepForm | None = None
        #: Why no call is forecast any more in this ``pipe(...)`` call; None while forecasts go on.
        self.refusal: str | None = None
        #: Steps the pipeline has made (its calls to ``scheduler.step``).
        self.steps = 0

    # The pipeline's side.

    def watch(self):
        """A context manager: the scheduler instance's ``step`` observed inside it, as it was after it."""
        return _watched_step(self)

    def scheduler_step(self, stock_step: Callable, signature: inspect.Signature, *args, **kwargs):
        """Stands in for ``scheduler.step``: learns or checks the guidance and the timestep, keeps the new latent."""
        bound = signature.bind(*args, **kwargs)
        prediction, timestep = bound.arguments["model_output"], bound.arguments["timestep"]
        if self.refusal is None:
            self._check_guidance(prediction)
            self._check_timestep(timestep)
        output = stock_step(*args, **kwargs)
        self.latent, self.timestep = output[0], timestep
        self.step_arguments = {
            name: value for name, value in bound.arguments.items() if name not in ("model_output", "timestep", "sample")
        }
        self.previous, self.current = self.current, []
        self.steps += 1
        return output

    def copied(self) -> None:
        """The pipeline copied its scheduler during the call: its copies' steps are out of sight."""
        self.refuse("the pipeline copies its scheduler during the call, and its copies' steps are not reproduced")

    def refuse(self, reason: str) -> None:
        if self.refusal is None:
            self.refusal = reason

    # The denoiser's side.

    @torch.compiler.disable
    def observe_call(self, context: str | None, arguments: dict) -> None:
        """A denoiser call starts with ``arguments`` (by name) in cache context ``context``."""
        self.current.append(Call(context, dict(arguments)))
        if self.refusal is None and len(self.current) == 1 and self.latent is not None:
            self._check_input(arguments[self.latent_arg])

    @torch.compiler.disable
    def observe_output(self, output: torch.Tensor) -> None:
        """The running call returned ``output`` (the whole prediction, on every rank)."""
        self.current[-1].output = output

    # The forecast.

    def upcoming(self) -> Upcoming | None:
        """The call the pipeline makes after the running one; None when none is forecast (none comes, or the loop
        is not learned yet, or it stopped matching)."""
        if self.refusal is not None or not self.previous or not self.current:
            return None
        running, index = self.current[-1], len(self.current)
        if index < len(self.previous):
            upcoming = Upcoming(self.previous[index].context, False, self.previous[index])
        elif None in (self.guidance, self.input, self.time) or self._timesteps()[1] is None:
            return None
        else:
            upcoming = Upcoming(self.current[0].context, True, self.current[0])
        return upcoming if _same_shapes(upcoming.template.arguments, running.arguments) else None

    def arguments(self, upcoming: Upcoming, latent: torch.Tensor | None = None) -> dict:
        """The arguments of the ``upcoming`` call, its latent argument ``latent`` (a new step; None: this step's as a
        stand-in, for a stage that needs every argument but the latent's values)."""
        arguments = dict(upcoming.template.arguments)
        first = self.current[0].arguments
        if not upcoming.new_step:
            arguments[self.latent_arg], arguments[self.timestep_arg] = first[self.latent_arg], first[self.timestep_arg]
            return arguments
        arguments[self.timestep_arg] = self.time(self._timesteps()[1])
        arguments[self.latent_arg] = first[self.latent_arg] if latent is None else latent
        return arguments

    def latent_after(self, output: torch.Tensor) -> torch.Tensor:
        """The latent argument of the next step's first call, given the running call's ``output``: right at every
        position where ``output`` (and this step's earlier outputs) are."""
        outputs = [call.output for call in self.current[:-1]] + [output]
        scheduler = scheduler_copy(self.scheduler)
        timestep, following = self._timesteps()
        prediction = self.guidance(outputs, self.latent.dtype)
        stepped = scheduler.step(prediction, timestep, self.latent, **_fresh_generators(self.step_arguments))[0]
        return self.input(stepped, scheduler, following)

    # Learning and checking.

    def _timesteps(self) -> tuple:
        """The scheduler's timesteps of the step in progress and of the next one (None where there is none)."""
        return upcoming_timesteps(self.scheduler, self.timestep)

    def _check_guidance(self, prediction: torch.Tensor) -> None:
        outputs = [call.output for call in self.current]
        if any(output is None for output in outputs):
            return self.refuse("a denoiser call of the step returned no output paradiff saw")
        if self.guidance is None:
            self.guidance = fit_guidance(outputs, prediction)
            if self.guidance is None:
                self.refuse(
                    f"the prediction the pipeline hands scheduler.step is none of the CFG combinations paradiff "
                    f"reproduces (of {len(outputs)} denoiser call(s) per step)"
                )
        elif not _equal(self.guidance(outputs, prediction.dtype), prediction):
            self.refuse(
                f"the pipeline's guidance changed at step {self.steps} (a guidance scale that varies per step?)"
            )

    def _check_timestep(self, timestep) -> None:
        passed = self.current[0].arguments.get(self.timestep_arg) if self.current else None
        if self.time is None:
            self.time = fit_timestep(timestep, passed)
            if self.time is None:
                self.refuse("the denoiser's timestep argument is none of t, t / 1000, 1000 - t of the scheduler's")
        elif not _equal(self.time(timestep), passed):
            self.refuse(f"the denoiser's timestep argument at step {self.steps} is not the scheduler's timestep's")

    def _check_input(self, passed) -> None:
        timestep = self._timesteps()[0]
        if self.input is None:
            self.input = fit_input(self.latent, passed, self.scheduler, timestep)
            if self.input is None:
                self.refuse(
                    "the denoiser's latent argument is not the scheduler's latent (repeated for CFG, through "
                    "scale_model_input or not)"
                )
        elif not _equal(self.input(self.latent, scheduler_copy(self.scheduler), timestep), passed):
            self.refuse(
                f"the latent the pipeline passed at step {self.steps} is not the one its scheduler returned "
                "(a callback that edits latents?)"
            )


def fit_guidance(outputs: list[torch.Tensor], prediction: torch.Tensor) -> Guidance | None:
    """The :class:`Guidance` that turns ``outputs`` into ``prediction`` bit for bit, or None."""
    batch, first = prediction.shape[0], outputs[0]
    kinds = []
    if len(outputs) == 1 and first.shape[0] == batch:
        kinds.append("none")
    if len(outputs) == 1 and first.shape[0] == 2 * batch:
        kinds.append("batch")
    if len(outputs) == 2 and all(output.shape == first.shape for output in outputs) and first.shape[0] == batch:
        kinds.append("calls")
    doubled = first.ndim >= 2 and first.shape[2:] == prediction.shape[2:] and first.shape[1] == 2 * prediction.shape[1]
    halves = [True] if doubled else [False] if first.shape[1:] == prediction.shape[1:] else []
    casts = [None] if first.dtype == prediction.dtype else [None, prediction.dtype]
    for kind, half, cast, rescaled in itertools.product(kinds, halves, casts, (False, True)):
        if rescaled and kind == "none":
            continue
        for scale in _scales(kind, outputs, prediction, half, rescaled):
            guidance = Guidance(kind, scale, half, cast, rescaled)
            if _equal(guidance(outputs, prediction.dtype), prediction):
                return guidance
    return None


def _scales(kind: str, outputs: list[torch.Tensor], prediction: torch.Tensor, half: bool, rescaled: bool) -> list:
    """The guidance scale that fits ``prediction`` best (least squares), as float32, and its two float32 neighbours.

    Rescaled per token, only each token's direction is known: the scale that makes ``u + g·(c − u)`` most nearly
    parallel to the prediction's, token by token.
    """
    if kind == "none":
        return [1.0]
    uncond, cond = outputs[0].chunk(2) if kind == "batch" else (outputs[1], outputs[0])
    if half:
        uncond, cond = uncond.chunk(2, dim=1)[0], cond.chunk(2, dim=1)[0]
    uncond, difference, target = uncond.double(), cond.double() - uncond.double(), prediction.double()
    if rescaled:  # u + g·d minus its part along the prediction's direction, per token: a + g·b
        direction = target / torch.norm(target, dim=-1, keepdim=True).clamp_min(1e-300)
        uncond = uncond - (uncond * direction).sum(-1, keepdim=True) * direction
        difference = difference - (difference * direction).sum(-1, keepdim=True) * direction
        target = torch.zeros_like(target)
    difference, residual = difference.flatten(), (target - uncond).flatten()
    norm = float(difference @ difference)
    fitted = float(residual @ difference) / norm if norm else 1.0
    best = torch.tensor(fitted, dtype=torch.float32)
    neighbours = [torch.nextafter(best, torch.tensor(bound, dtype=torch.float32)) for bound in (-1e30, 1e30)]
    return [float(best), *(float(n) for n in neighbours)]


def fit_input(latent: torch.Tensor, passed, scheduler, timestep) -> InputForm | None:
    """The :class:`InputForm` that makes ``passed`` from ``latent`` bit for bit, or None."""
    if not isinstance(passed, torch.Tensor) or passed.shape[1:] != latent.shape[1:] or timestep is None:
        return None
    if passed.shape[0] % latent.shape[0]:
        return None
    for scaled in (False, True):
        form = InputForm(passed.shape[0] // latent.shape[0], scaled, passed.dtype)
        if _equal(form(latent, scheduler_copy(scheduler), timestep), passed):
            return form
    return None


def fit_timestep(timestep, passed) -> TimestepForm | None:
    """The :class:`TimestepForm` that makes ``passed`` from the scheduler's ``timestep`` bit for bit, or None."""
    if not isinstance(passed, torch.Tensor):
        return None
    for form in TIMESTEP_FORMS:
        for cast_first in (False, True):
            candidate = TimestepForm(form, cast_first, passed)
            if _equal(candidate(timestep), passed):
                return candidate
    return None


def scheduler_copy(scheduler):
    """An independent scheduler in the same state, without anything put on the instance (a wrapped ``step``)."""
    clone = object.__new__(type(scheduler))
    clone.__dict__ = copy.deepcopy({name: value for name, value in vars(scheduler).items() if name != "step"})
    return clone


def upcoming_timesteps(scheduler, previous) -> tuple:
    """The timesteps ``scheduler`` steps next and after that (None where the schedule ends): by its step index,
    else (DDIM counts none) from the one after ``previous``, the timestep of its last step."""
    timesteps = scheduler.timesteps
    index = getattr(scheduler, "step_index", None)
    if index is None:
        if previous is None:
            return None, None
        matches = (timesteps == torch.as_tensor(previous).to(timesteps.device)).nonzero()
        if not len(matches):
            return None, None
        index = int(matches[0, 0]) + 1
    return tuple(timesteps[i] if i < len(timesteps) else None for i in (index, index + 1))


def _fresh_generators(arguments: dict) -> dict:
    """``arguments`` with every ``torch.Generator`` replaced by a clone in its current state."""

    def fresh(value):
        if isinstance(value, torch.Generator):
            clone = torch.Generator(device=value.device)
            clone.set_state(value.get_state())
            return clone
        if isinstance(value, (list, tuple)):
            return type(value)(fresh(v) for v in value)
        return value

    return {name: fresh(value) for name, value in arguments.items()}


def _equal(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def _same_shapes(arguments: dict, others: dict) -> bool:
    """Whether every argument that is a tensor in both calls has the same shape in both (so that every message
    between the stages keeps its size)."""
    return all(
        value.shape == others[name].shape
        for name, value in arguments.items()
        if isinstance(value, torch.Tensor) and isinstance(others.get(name), torch.Tensor)
    )


class _ObservedStep(functools.partial):
    """The scheduler instance's ``step`` during one ``pipe(...)`` call, reporting to a :class:`NextCall`.

    A pipeline that deep-copies its scheduler during the call gets a copy whose ``step`` is the class's
    own, and the forecasts end (the copies' steps are out of sight).
    """

    def __deepcopy__(self, memo):
        forecast = self.func.__self__
        forecast.copied()
        clone = memo.get(id(forecast.scheduler))
        return types.MethodType(type(forecast.scheduler).step, clone) if clone is not None else self


class _watched_step:
    def __init__(self, forecast: NextCall):
        self.forecast = forecast

    def __enter__(self):
        scheduler = self.forecast.scheduler
        self.shadowed = vars(scheduler).get("step")
        stock = scheduler.step
        wrapper = _ObservedStep(self.forecast.scheduler_step, stock, inspect.signature(stock))
        scheduler.step = functools.update_wrapper(wrapper, stock)
        return self.forecast

    def __exit__(self, *exc):
        scheduler = self.forecast.scheduler
        if self.shadowed is None:
            del scheduler.step
        else:
            scheduler.step = self.shadowed
        return False
