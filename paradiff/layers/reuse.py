"""The denoiser hook of step parallelism: run the model at this rank's steps, reuse its last output at the others."""

from __future__ import annotations

from collections.abc import Callable

from ..compat import CallContextHook
from ..runtime.step_rounds import StepRounds
from .split import output_sample, replace_output_sample


class StepReuseHook(CallContextHook):
    """On the denoiser: outside a parallel ``pipe(...)`` call it is transparent.

    Inside one, each call is identified by its slot (cache context, e.g. Flux true CFG's "cond" and
    "uncond", and its index among the step's calls there), so a pipeline that calls the denoiser twice
    per step reuses each call's own output. A slot seen for the first time always runs the model.
    """

    def __init__(self, current_rounds: Callable[[], StepRounds | None]):
        super().__init__()
        self.current_rounds = current_rounds

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        rounds = self.current_rounds()
        if rounds is None:
            return forward(*args, **kwargs)
        slot = rounds.slot(self.context.name)
        cached = rounds.cache.get(slot)
        if cached is not None and not rounds.runs_model():
            output, sample = cached
            return replace_output_sample(output, sample.clone())  # a copy: the pipeline may change it in place
        output = forward(*args, **kwargs)
        rounds.cache[slot] = (output, output_sample(output).detach().clone())
        guard = rounds.comm.state.guard
        if guard is not None:
            guard.begin()
            guard.observe(rounds.step, rounds.cache[slot][1])
        return output
