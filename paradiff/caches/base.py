"""What one kind of step cache declares: the hooks that make it up, what it needs of a parallel run, its adaptation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from diffusers.hooks import ModelHook
from torch import nn

from ..compat import move_hook_outermost
from ..errors import ParadiffError
from ..runtime.shared_measure import SharedMeasure
from ..runtime.step_state import StepState

if TYPE_CHECKING:
    from ..runtime.comm import Communicator
    from ..strategies.installation import Installation


@dataclass(frozen=True)
class FoundHook:
    """One of a cache's hooks on the model: where it sits and under which name its registry holds it."""

    module_name: str
    module: nn.Module
    hook_name: str
    hook: ModelHook


@dataclass(frozen=True)
class CallShares:
    """Which ranks hold part of the denoiser call in progress, and how the CFG split runs it.

    ``tokens``: the strategy's group when it cuts every call's tokens (``Strategy.call_split == "tokens"``);
    ``cfg``: the CFG split's group. Every rank reads them alike, so every rank agrees over the same groups.
    """

    tokens: Communicator | None
    cfg: Communicator | None

    def groups(self) -> list[Communicator]:
        """The groups over which the call in progress is spread: the strategy's, then the CFG split's while it
        halves the call's batch (not while it runs one of two-call guidance's two calls per group)."""
        halves = self.cfg is not None and self.cfg.state.cfg_call == "halves"
        return [comm for comm in (self.tokens, self.cfg if halves else None) if comm is not None]

    @property
    def measure(self) -> SharedMeasure:
        return SharedMeasure(self.groups)


class StepCache:
    """One kind of diffusers step cache, as applied to one model (``hooks``): what it needs, how it is adapted.

    A subclass per cache declares diffusers' hook classes that make it up (``hook_classes``) and, for each way a
    strategy splits a denoiser call (``Strategy.call_split``) that the cache cannot run under, why (``needs``:
    what the cache does that the split breaks). ``adapt`` changes this model's hooks, this instance only, so that
    every rank takes the cache's decisions alike and as one device would.
    """

    #: The name diffusers gives it (messages use it).
    name: ClassVar[str] = ""
    #: diffusers' hook classes that make it up.
    hook_classes: ClassVar[tuple[type, ...]] = ()
    #: For each call split it cannot run under: what the cache does that such a split breaks.
    needs: ClassVar[dict[str, str]] = {}
    #: What the cache does that a CFG split of two-call guidance breaks (one call of each step per group); None:
    #: nothing. Two-call guidance shows only when the pipeline runs, so that refusal comes at its first step.
    two_call_split: ClassVar[str | None] = None

    def __init__(self, hooks: list[FoundHook]):
        self.hooks = hooks

    def refusal(self, split: str | None) -> str | None:
        """What the cache does that a call split ``split`` breaks; None when it runs under it."""
        return self.needs.get(split)

    def adapt(self, installed: Installation, shares: CallShares) -> None:
        """Change this model's cache hooks to run over the ranks ``shares`` describes.

        By default each hook on a module below the denoiser is moved outside the strategy's hooks on that module,
        so that a layer the cache skips skips the strategy's work in it too (an exchange of its keys and values,
        a check that it attended), on every rank alike.
        """
        for found in self.hooks:
            if found.module is not installed.model:
                move_outermost(found)

    def describe(self) -> str:
        """What the ranks compare at ``parallelize``: the cache and the modules it is on."""
        return f"{self.name} on {len(self.hooks)} modules"


class SecondCallRefusal(ModelHook):
    """On a cache's first hooked module: refuse a step's second call of two-call guidance under the CFG split.

    The CFG split marks each call it pairs (``StepState.cfg_call``); every rank runs both calls of the first step,
    so every rank refuses at the same call, before the split hands out any call.
    """

    def __init__(self, cfg_state: StepState, message: str):
        super().__init__()
        self.cfg_state, self.message = cfg_state, message

    def pre_forward(self, module, *args, **kwargs):
        if self.cfg_state.cfg_call == "second":
            raise ParadiffError(self.message)
        return args, kwargs


def move_outermost(found: FoundHook) -> None:
    """Make ``found``'s hook run outside every hook on its module (those the strategy put there included)."""
    move_hook_outermost(found.module, found.hook_name)
