"""Every private diffusers name paradiff uses, with what each supported diffusers version needs.

paradiff installs hooks on unmodified diffusers models and swaps their attention processors, so it
reads a few of diffusers' internals. They all live here; the rest of paradiff imports them from
this module only. The supported versions are those ``pyproject.toml`` allows (diffusers 0.38 and
later); where they differ:

* The name ``model.cache_context(name)`` gives stateful hooks: 0.38–0.40 store it in
  ``StateManager._current_context``, 0.41 and later a ``CacheContext`` in ``StateManager._context``.
* diffusers caches each registry's list of hooked submodules; 0.38–0.40 without a way to clear it
  (:func:`invalidate_hook_cache` clears it itself), 0.41 added ``invalidate_child_registries_cache``.
* Before 0.41 ``enable_parallelism`` computes the device and records the config itself (on CPU it
  computes ``cpu``, which is right); 0.41 moved that into ``_resolve_parallel_config``, which divides
  by the accelerator count and so fails on CPU: :func:`recording_parallel_config` replaces it.
* Ulysses gives each rank whole heads: before 0.42 their count must divide by the ranks; 0.42's
  ``ulysses_anything`` pads the last rank's heads (:func:`ulysses_pads_heads`).

diffusers 0.36–0.37 are not supported: their ``ContextParallelConfig`` takes no ``mesh`` and their
``enable_parallelism`` builds its own over every rank, so ``ulysses`` can neither run over paradiff's
process groups (and their timeout) nor within the halves of a CFG split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import diffusers
import torch
from diffusers import ContextParallelConfig
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.hooks import BaseState, StateManager
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import _get_qkv_projections
from torch import nn

from .errors import ParadiffError

__all__ = [
    "CallContextHook",
    "CallContextName",
    "ContextParallelInput",
    "ContextParallelOutput",
    "DispatchedAttentionProcessor",
    "active_attention_backend",
    "block_returns_image_first",
    "clear_parallel_config",
    "context_parallel_backend_available",
    "context_parallel_backends",
    "applied_cache_config",
    "dispatch_attention_fn",
    "first_block_decision",
    "flux_qkv_projections",
    "hook_registries",
    "invalidate_hook_cache",
    "loop_length",
    "move_hook_outermost",
    "parallel_config_of",
    "recording_parallel_config",
    "remove_hook",
    "replace_first_block_decision",
    "shipped_context_parallel_plan",
    "ulysses_gathers_key_masks",
    "ulysses_pads_heads",
]


# Hooks and call contexts.


class CallContextName(StateManager):
    """Receives the name diffusers' ``model.cache_context(name)`` sets on stateful hooks."""

    def __init__(self):
        super().__init__(BaseState)

    @property
    def name(self) -> str | None:
        if hasattr(self, "_context"):  # diffusers >= 0.41: a CacheContext, or None outside a context
            return self._context.name if self._context is not None else None
        if hasattr(self, "_current_context"):  # diffusers 0.38–0.40: the name itself
            return self._current_context
        raise ParadiffError(
            "this diffusers version's StateManager keeps the cache_context name neither in _context nor in "
            "_current_context; install a diffusers version paradiff supports (see its pyproject.toml)"
        )


class CallContextHook(ModelHook):
    """Base of paradiff's hooks that must know the ``cache_context`` a call runs in (``self.context.name``).

    diffusers hands the name only to hooks that declare themselves stateful, through the
    :class:`CallContextName` among their attributes. paradiff keeps no state in the hook that diffusers
    would have to reset: each strategy's step state is reset at every ``pipe(...)`` call.
    """

    _is_stateful = True

    def __init__(self):
        super().__init__()
        self.context = CallContextName()

    def reset_state(self, module):
        return module


def remove_hook(module: nn.Module, name: str) -> None:
    """Remove the hook registered under ``name`` on ``module`` only (not on its submodules); the hooks registered
    after it keep working.

    diffusers' ``remove_hook`` of a hook that a later hook wraps points the later hook's link at the forward below,
    in place of the later hook's own ``new_forward``, which is then never called. So the later hooks are taken
    off first, outermost first, and registered again, in their order, once the hook is gone.
    """
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None or name not in registry.hooks:
        return
    order = list(registry.hooks)  # registration order
    later = {other: registry.hooks[other] for other in order[order.index(name) + 1 :]}
    for other in reversed(later):
        registry.remove_hook(other, recurse=False)
    registry.remove_hook(name, recurse=False)
    for other, hook in later.items():
        registry.register_hook(hook, other)


def move_hook_outermost(module: nn.Module, name: str) -> None:
    """Make the hook registered under ``name`` on ``module`` run outside every other hook there (registered anew:
    diffusers starts it afresh); nothing changes if it already does."""
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if list(registry.hooks)[-1] == name:
        return
    hook = registry.hooks[name]
    remove_hook(module, name)
    registry.register_hook(hook, name)


def invalidate_hook_cache(module: nn.Module) -> None:
    """Make diffusers find the hooked submodules of ``module`` afresh (after hooks were added or removed).

    Without it, diffusers keeps handing ``cache_context`` names to a stale list of hooks.
    """
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()
        return
    for submodule in module.modules():  # diffusers 0.38–0.40: a cache without a method to clear it
        if hasattr(submodule, "_diffusers_hook"):
            submodule._diffusers_hook._child_registries_cache = None


def hook_registries(model: nn.Module) -> Iterator[tuple[str, nn.Module, HookRegistry]]:
    """``(qualified name, module, its hook registry)`` of every module of ``model`` that has hooks, ``model`` first."""
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None:
            yield name, module, registry


# Step caches (``paradiff.caches``).


def applied_cache_config(model: nn.Module):
    """The config ``model.enable_cache(config)`` applied (diffusers' ``CacheMixin``), or None."""
    return getattr(model, "_cache_config", None)


def first_block_decision(hook):
    """FirstBlockCache's own decision of ``hook`` (its head block's hook): ``decide(residual) -> run the others``."""
    return type(hook)._should_compute_remaining_blocks.__get__(hook)


def replace_first_block_decision(hook, decide) -> Callable[[], None]:
    """Make this FirstBlockCache head hook (this instance only) decide with ``decide(residual)``; returns the undo."""
    hook._should_compute_remaining_blocks = decide
    return lambda: vars(hook).pop("_should_compute_remaining_blocks", None)


# Transformer blocks.


@cache
def block_returns_image_first(block_class: type) -> bool:
    """Whether a block that carries text and image tokens returns ``(image, text)`` rather than ``(text, image)``.

    From diffusers' ``TransformerBlockRegistry`` (the class or its nearest registered base). Unregistered
    classes get ``(text, image)``, the order of diffusers' joint-attention blocks (SD3, Flux), several of
    which older diffusers versions do not register.
    """
    for cls in block_class.__mro__:
        try:
            metadata = TransformerBlockRegistry.get(cls)
        except ValueError:  # not registered
            continue
        return metadata.return_hidden_states_index == 0
    return False


def flux_qkv_projections(attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """Flux's own Q, K, V projections of the image and the text tokens (fused or not), as six tensors."""
    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


# Attention backends and processors.


def context_parallel_backends() -> list[str]:
    """Names of the attention backends diffusers can run context parallelism in, sorted."""
    return sorted(_AttentionBackendRegistry._supports_context_parallel)


def context_parallel_backend_available(backend: str) -> bool:
    """Whether diffusers can run context parallelism in ``backend`` here (registered for it, its library present)."""
    try:
        name = AttentionBackendName(backend)
    except ValueError:  # not a backend diffusers knows
        return False
    return bool(_AttentionBackendRegistry._is_context_parallel_available(name))


def active_attention_backend(model: nn.Module | None = None) -> str:
    """The backend diffusers will attend with: one set on ``model``'s processors, else the process-wide default."""
    for module in model.modules() if model is not None else ():
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        if backend is not None:
            return AttentionBackendName(backend).value
    return _AttentionBackendRegistry.get_active_backend()[0].value


class DispatchedAttentionProcessor:
    """Base of paradiff's attention processors: attention runs in diffusers' dispatcher.

    diffusers fills these attributes on every processor that declares them: ``set_attention_backend``
    the backend, ``enable_parallelism`` the parallel config (then the dispatcher runs Ulysses or ring).
    """

    _attention_backend = None
    _parallel_config = None

    def dispatch(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, parallel: bool = True
    ) -> torch.Tensor:
        """Attention of ``(batch, tokens, heads, head_dim)`` inputs as ``(batch, tokens, heads · head_dim)``.

        ``parallel=False`` attends over the given tokens only, even under diffusers' context parallelism.
        """
        config = self._parallel_config if parallel else None
        out = dispatch_attention_fn(query, key, value, backend=self._attention_backend, parallel_config=config)
        return out.flatten(2, 3).to(query.dtype)


# Context parallelism (``enable_parallelism``).


#: The first diffusers release known to extend a key mask over the keys Ulysses gathers (0.38 passes each rank's
#: local mask against the whole sequence's keys; 0.42 gathers it).
ULYSSES_MASKS_FROM = "0.42"


def ulysses_gathers_key_masks() -> bool:
    """Whether this diffusers' Ulysses attention completes an attention mask over the gathered keys."""
    release = tuple(int(part) for part in diffusers.__version__.split(".")[:2])
    return release >= tuple(int(part) for part in ULYSSES_MASKS_FROM.split("."))


def ulysses_pads_heads() -> bool:
    """Whether this diffusers' Ulysses can run head counts the ranks do not divide: ``ContextParallelConfig``'s
    ``ulysses_anything`` (0.42 on) pads the last rank's heads with zeros and drops them after attention."""
    return "ulysses_anything" in {field.name for field in dataclasses.fields(ContextParallelConfig)}


def shipped_context_parallel_plan(model: nn.Module) -> dict | None:
    """The context-parallel plan diffusers ships with ``model``'s class (its ``_cp_plan``), or None."""
    return getattr(type(model), "_cp_plan", None)


def parallel_config_of(model: nn.Module):
    """The diffusers ``ParallelConfig`` ``model`` runs under, or None."""
    return getattr(model, "_parallel_config", None)


@contextmanager
def recording_parallel_config(model: nn.Module, config) -> Iterator[None]:
    """Inside, ``model.enable_parallelism`` takes ``config`` (already set up) as it is instead of resolving one.

    diffusers >= 0.41 resolves the config in ``model._resolve_parallel_config``, computing a device from
    the accelerator count (which fails on CPU) and building a mesh; this shadows it on this instance for
    the duration only. Older versions do not call it, and set up ``config`` again with the mesh it carries.
    """

    def resolved(_config):
        model._parallel_config = config
        return config

    model._resolve_parallel_config = resolved
    try:
        yield
    finally:
        del model._resolve_parallel_config


def clear_parallel_config(model: nn.Module, config) -> None:
    """Drop ``config`` from ``model`` and from every attention processor ``enable_parallelism`` gave it to."""
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if getattr(processor, "_parallel_config", None) is config:
            del processor._parallel_config  # back to the class's None
    if "_parallel_config" in vars(model):
        del model._parallel_config  # back to ModelMixin's None


def derived_context_parallel_meshes(cp_config) -> list:
    """The device meshes ``ContextParallelConfig.setup`` made from the given one (the sequence dimensions
    flattened into one, a process group of its own when there are other dimensions), kept in a private field."""
    flattened = getattr(cp_config, "_flattened_mesh", None)
    return [] if flattened is None else [flattened]


# Pipelines.


def loop_length(pipe) -> int | None:
    """Steps of the denoising loop in progress, as the pipeline recorded them before the loop (``_num_timesteps``).

    Most diffusers pipelines set it; None where this one does not (then the scheduler has to tell).
    """
    length = getattr(pipe, "_num_timesteps", None)
    return length if isinstance(length, int) and length > 0 else None


@contextmanager
def progress_bar_off(pipe) -> Iterator[None]:
    """The pipeline's progress bar off inside the block, its settings as they were after it.

    ``set_progress_bar_config`` only adds settings; diffusers keeps them in ``_progress_bar_config``.
    """
    settings = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    try:
        yield
    finally:
        pipe._progress_bar_config = settings
