"""Step parallelism, reuse-then-predict (``parastep``, ParaStep): N ranks compute N consecutive steps at once.

Every rank holds the whole pipeline and runs its stock loop. paradiff steers it through two extension
points every pipeline has, and nothing else:

* a hook on the denoiser (:class:`~paradiff.layers.reuse.StepReuseHook`) that runs the model at this
  rank's steps and returns its last output at the others;
* for the duration of each ``pipe(...)`` call, a wrapper of the ``step`` method of the pipeline's own
  scheduler *instance* (an instance attribute, removed when the call ends; the class is untouched).
  It counts the steps, applies the prediction agreed for each step, and ends each round with rank 0's
  latent and scheduler state (:mod:`paradiff.runtime.step_rounds` has the algorithm).

The user's callbacks (``callback_on_step_end``, or the older ``callback`` of PixArt) run as the stock
loop calls them, with the stock step indices; inside a round, the latents a callback sees on ranks
other than 0 are that rank's speculative ones. The model's class does not matter: the hook only calls
the denoiser or returns its last output, so any diffusers denoiser works (CogVideoX, for one).

With ``cfg_parallel=True`` the D ranks of each CFG half run the rounds among themselves; both halves
agree on every prediction, so they stay identical. The CFG split's hook wraps this one, so on reused
steps it still gathers the two (cached) halves: a small transfer, no model run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

from torch import nn

from ..compat import loop_length
from ..errors import ParadiffError
from ..layers.reuse import StepReuseHook
from ..models import DenoiserFamily
from ..runtime.comm import Communicator
from ..runtime.step_rounds import StepRounds
from .base import Strategy
from .costing import CostMachine, CostSetting, StepCost
from .installation import Installation

#: Why ``parastep`` refuses a pipeline that copies its scheduler during the call.
COPIED_SCHEDULER = (
    "strategy='parastep' keeps the pipeline's one scheduler in step across ranks, and this pipeline copies its "
    "scheduler during the call (one per frame block, as diffusion-forcing pipelines do); use strategy='dualparal' or "
    "'cfg' for it"
)


class _RoundsStep(functools.partial):
    """The wrapped ``scheduler.step``; a copy of the scheduler made during the call is refused by name.

    Step rounds keep one scheduler's state in step on every rank. A pipeline that deep-copies its
    scheduler during the call (diffusion-forcing pipelines step one copy per frame block) would copy this
    wrapper, process group and all, and step the copies out of the rounds' sight.
    """

    def __deepcopy__(self, memo):
        raise ParadiffError(COPIED_SCHEDULER)


class ParaStepInstallation(Installation):
    """The hook :class:`ParaStepStrategy` put on one denoiser, and the rounds of the call in progress."""

    def __init__(self, model: nn.Module, strategy: str, comm: Communicator):
        super().__init__(model, strategy)
        self.comm = comm
        self.rounds: StepRounds | None = None

    @contextlib.contextmanager
    def steer(self, pipe):
        """Wrap ``pipe.scheduler.step`` (this instance only) for one ``pipe(...)`` call."""
        scheduler = pipe.scheduler
        shadowed = vars(scheduler).get("step")  # a wrapper someone else put on the instance, restored after
        stock_step = scheduler.step
        rounds = StepRounds(self.comm, scheduler, lambda: loop_length(pipe))
        wrapper = _RoundsStep(rounds.scheduler_step, stock_step, inspect.signature(stock_step))
        scheduler.step = functools.update_wrapper(wrapper, stock_step)
        self.rounds = rounds
        try:
            yield
            rounds.finish()
        finally:
            self.rounds = None
            if shadowed is None:
                del scheduler.step
            else:
                scheduler.step = shadowed


class ParaStepStrategy(Strategy):
    name = "parastep"
    refreshes = "itself"
    call_split = "whole"
    model_agnostic = True

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """Warm-up steps on every rank alike; then rounds of N steps, one call per rank, and the predictions
        gathered."""
        call = m.compute(m.w.flops / m.groups)
        one = m.one_call
        guided = one.latent_bytes / (2 if one.batch % 2 == 0 else 1)  # the latents after CFG combined the halves
        nbytes = guided / m.groups * (n - 1)  # each round: this rank's step, to the others
        return StepCost(call, (call + m.transfer(nbytes, 2)) / n, 0.0, nbytes / n, m.weights)

    @classmethod
    def plan_refusal(cls, forcing: bool, block_loop: bool) -> str | None:
        return COPIED_SCHEDULER if forcing else None

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> ParaStepInstallation:
        installed = ParaStepInstallation(denoiser, self.name, comm)
        installed.hook(denoiser, StepReuseHook(lambda: installed.rounds))
        return installed.done()
