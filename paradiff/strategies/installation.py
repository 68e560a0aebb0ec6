"""What a strategy changed on one model — hooks, attention processors, anything else — undone exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from diffusers.hooks import HookRegistry
from torch import nn

from ..compat import invalidate_hook_cache, remove_hook


class Installation:
    """Registers a strategy's hooks and swaps attention processors on one model, and undoes both.

    Every hook is registered under one name (``paradiff.<strategy>``) on the modules it was put on, so
    :meth:`remove` takes away this strategy's hooks and no one else's; processors come back as they were.
    Other changes (freed parameters, diffusers' own parallelism) are undone by the callbacks given to
    :meth:`on_remove`, before the processors are restored.
    """

    def __init__(self, model: nn.Module, strategy: str):
        self.model = model
        self.hook_name = f"paradiff.{strategy}"
        self.hooked: list[nn.Module] = []
        self.processors: list[tuple[nn.Module, object]] = []
        self.undo: list[Callable[[], None]] = []

    def hook(self, module: nn.Module, hook) -> None:
        """Register ``hook`` on ``module``; hooks registered later run outside earlier ones."""
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, self.hook_name)
        self.hooked.append(module)

    def set_processor(self, attn: nn.Module, processor) -> None:
        self.processors.append((attn, attn.processor))
        attn.set_processor(processor)

    def on_remove(self, undo: Callable[[], None]) -> None:
        self.undo.append(undo)

    def done(self) -> Installation:
        """Call after the last hook: hooks on submodules take effect once the model's hook cache is rebuilt."""
        invalidate_hook_cache(self.model)
        return self

    def per_rank(self) -> set[int]:
        """``id`` of the tensors whose content differs between ranks by design (each rank's stage of the blocks):
        left out of what the ranks compare about the model at each call. None by default."""
        return set()

    def layout(self) -> dict:
        """The choices this installation made at run time that change its pictures, not only its speed, as the
        options that make them again; {} where there are none. The staleness guard's calibration holds on its own
        layout only."""
        return {}

    def adopt(self, layout: dict) -> bool:
        """Make the run-time choices of ``layout`` (another process's :meth:`layout`) where they are still open;
        whether this installation now runs that layout."""
        return layout == self.layout()

    def steer(self, pipe) -> contextlib.AbstractContextManager:
        """The strategy's hold on the pipeline's loop during one call; none by default."""
        return contextlib.nullcontext()

    def remove(self) -> None:
        for module in self.hooked:
            remove_hook(module, self.hook_name)
        for undo in reversed(self.undo):
            undo()
        for attn, processor in reversed(self.processors):
            attn.set_processor(processor)
        invalidate_hook_cache(self.model)
