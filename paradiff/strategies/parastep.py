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
from dataclasses import dataclass

from diffusers.hooks import HookRegistry
from torch import nn

from ..config import ParallelConfig
from ..layers.reuse import StepReuseHook
from ..models import DenoiserFamily
from ..runtime.comm import Communicator
from ..runtime.step_rounds import StepRounds

HOOK_NAME = "paradiff.parastep"


@dataclass
class InstalledParaStep:
    """The hook :class:`ParaStepStrategy` put on one denoiser, and the rounds of the call in progress."""

    denoiser: nn.Module
    comm: Communicator
    rounds: StepRounds | None = None

    @contextlib.contextmanager
    def steer(self, pipe):
        """Wrap ``pipe.scheduler.step`` (this instance only) for one ``pipe(...)`` call."""
        scheduler = pipe.scheduler
        shadowed = vars(scheduler).get("step")  # a wrapper someone else put on the instance, restored after
        stock_step = scheduler.step
        rounds = StepRounds(self.comm, scheduler, lambda: getattr(pipe, "_num_timesteps", None))
        wrapper = functools.partial(rounds.scheduler_step, stock_step, inspect.signature(stock_step))
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

    def remove(self) -> None:
        self.denoiser._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)


class ParaStepStrategy:
    name = "parastep"
    #: Steps after warm-up are computed from speculative latents: ``warmup_steps`` trades speed for fidelity.
    uses_warmup = True
    #: Needs no knowledge of the denoiser's layers: any diffusers denoiser (without a CFG split).
    model_agnostic = True

    @classmethod
    def create(cls, config, groups) -> ParaStepStrategy:
        return cls()

    @classmethod
    def check_model(cls, denoiser: nn.Module, family: DenoiserFamily, degree: int, config: ParallelConfig) -> None:
        """Nothing to refuse: every rank runs the whole denoiser."""

    def check_height(self, denoiser: nn.Module, comm: Communicator, height: int, vae_scale_factor: int) -> None:
        """Any size works: nothing is cut."""

    def install(
        self, denoiser: nn.Module, family: DenoiserFamily, comm: Communicator, vae_scale_factor: int
    ) -> InstalledParaStep:
        installed = InstalledParaStep(denoiser, comm)
        hook = StepReuseHook(lambda: installed.rounds)
        HookRegistry.check_if_exists_or_initialize(denoiser).register_hook(hook, HOOK_NAME)
        return installed
