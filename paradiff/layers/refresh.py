"""The hook that lets the staleness guard refresh displaced steps (``fidelity_floor_db``).

It wraps the strategy's own hooks on the denoiser: before the first call of a step past warm-up it asks the
guard (``runtime.staleness``) whether the step refreshes and, if so, marks it in the strategy's step state, whose
``synchronous`` the strategy's layers read; after each call it hands the guard the prediction.
"""

from __future__ import annotations

from ..compat import CallContextHook
from ..models.base import DenoiserFamily, bind_inputs
from ..runtime.staleness import StalenessGuard
from .split import output_sample


class RefreshHook(CallContextHook):
    def __init__(self, family: DenoiserFamily, guard: StalenessGuard):
        super().__init__()
        self.family, self.guard = family, guard
        self.step = 0

    def pre_forward(self, module, *args, **kwargs):
        guard, state = self.guard, self.guard.comm.state
        guard.begin()
        timestep = bind_inputs(module, args, kwargs).arguments.get(self.family.timestep_arg, 0)
        self.step, _ = state.peek(self.context.name, timestep)
        if self.step > state.warmup_steps and guard.decide(self.step):
            state.refreshed.add(self.step)
        return args, kwargs

    def post_forward(self, module, output):
        self.guard.observe(self.step, output_sample(output))
        return output
