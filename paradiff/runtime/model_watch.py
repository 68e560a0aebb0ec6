"""What a parallelized pipeline's model is at each call: compared with the other ranks, and with this rank's last call.

A model may change after ``parallelize``: LoRA adapters loaded, unloaded, fused, re-weighted or hot-swapped,
QKV projections fused, weights quantized or cast, a new scheduler set. Ranks that change it differently
return one wrong image silently, and a strategy whose hooks sit on a layer that was swapped out runs the
wrong layer. So before every call each rank describes, per component, its modules (class names), its
adapters (names, scales, merged or not) and a checksum of its weights, plus
the scheduler's class and config: the ranks agree on that description like on the call's arguments. Each
rank also keeps the identities of its modules, processors and parameters from the last call: when they
changed, the pipeline re-installs its strategy on the model as it now is (or refuses, for a strategy that
cannot).

Each tensor's checksum is recomputed only when its ``_version`` counter or storage says it was written since
the last call (:class:`~paradiff.runtime.weights.SumCache`), so a call reads no weights it read before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .weights import SumCache, combined

#: Module names listed in a description of what changed, at most.
SHOWN_NAMES = 3


def _hash(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:12]


def modules_of(pipe) -> dict[str, nn.Module]:
    """The pipeline's torch components by name, in name order."""
    components = getattr(pipe, "components", {})
    return {name: module for name, module in sorted(components.items()) if isinstance(module, nn.Module)}


def describe_scheduler(pipe) -> str | None:
    """The scheduler's class and a hash of its public config; None without a scheduler."""
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is None:
        return None
    public = {key: value for key, value in getattr(scheduler, "config", {}).items() if not key.startswith("_")}
    settings = json.dumps(public, sort_keys=True, default=str)  # private keys list sets in any order
    return f"{type(scheduler).__qualname__}, config sha {_hash(settings)}"


def describe_adapters(modules: list[tuple[str, nn.Module]]) -> str:
    """The adapters on these ``(name, module)`` layers (peft's tuner layers, read by their attributes): which are
    active, merged or disabled, and their scales."""
    layers = [(name, m) for name, m in modules if "merged_adapters" in vars(m)]
    if not layers:
        return "none"
    active = sorted({adapter for _, m in layers for adapter in m.active_adapters})
    state = [
        (name, sorted(m.active_adapters), list(m.merged_adapters), bool(m.disable_adapters), _scales(m))
        for name, m in layers
    ]
    merged = sorted({adapter for _, m in layers for adapter in m.merged_adapters})
    shown = f"active {active}" + (f", merged {merged}" if merged else "")
    return f"{len(layers)} adapted layers, {shown}, sha {_hash(json.dumps(state, default=str))}"


def _scales(layer: nn.Module) -> list:
    return sorted((str(key), float(value)) for key, value in getattr(layer, "scaling", {}).items())


@dataclass
class Snapshot:
    """One rank's view of a model at one call."""

    #: Per component: ``(name, id)`` of each module and of its processor, ``(name, id, dtype)`` of each tensor.
    identities: dict[str, tuple]
    #: Per component: the description the ranks agree on (module classes, adapters, weights of every rank's tensors;
    #: not processors, which a strategy may set on one rank's layers only).
    description: dict[str, str]
    #: Per component: each tensor's sum, to say which changed.
    sums: dict[str, dict[str, float]]


def _tensors(modules: list[tuple[str, nn.Module]]) -> dict[str, torch.Tensor]:
    """The parameters and buffers of these modules by full name, each once (one walk over the modules, not one per
    module as ``named_parameters`` makes: a call walks every component's modules)."""
    named, seen = {}, set()
    for prefix, module in modules:
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    named[f"{prefix}.{key}" if prefix else key] = tensor
    return named


def snapshot(pipe, per_rank: Callable[[], set[int]], cache: SumCache) -> Snapshot:
    """The pipeline's components now; ``per_rank()`` gives the ``id`` of tensors whose content differs between ranks
    by design (a stage of blocks each rank keeps alone), left out of what the ranks compare; ``cache`` keeps the
    tensors' sums from one call to the next."""
    identities, description, sums = {}, {}, {}
    excluded = per_rank()
    for name, module in modules_of(pipe).items():
        modules = list(module.named_modules())
        named = _tensors(modules)
        identities[name] = tuple((child, id(m), id(vars(m).get("processor"))) for child, m in modules) + tuple(
            (key, id(tensor), tensor.dtype) for key, tensor in named.items()
        )
        kinds = [(child, type(m).__qualname__) for child, m in modules]
        description[f"{name} layers"] = f"{len(kinds)} modules, sha {_hash(json.dumps(kinds))}"
        description[f"{name} adapters"] = describe_adapters(modules)
        values = dict(zip(named, cache.sums(list(named.values())), strict=True))
        shared = [value for key, value in values.items() if id(named[key]) not in excluded]
        description[f"{name} weights"] = f"checksum {combined(shared):.10e}"
        sums[name] = values
    scheduler = describe_scheduler(pipe)
    if scheduler is not None:
        description["scheduler"] = scheduler
    return Snapshot(identities, description, sums)


@dataclass
class Changes:
    """What changed on one rank between two snapshots."""

    #: Components whose modules, processors or parameters were replaced, added or removed: their strategy's
    #: hooks may sit on what is no longer there.
    replaced: list[str]
    #: What changed, coarsely ("transformer layers", "scheduler"): the ranks agree on it.
    kinds: list[str]
    #: What changed, in words, naming the modules and tensors.
    said: list[str]


def changes(before: Snapshot, after: Snapshot) -> Changes:
    """What changed between two snapshots of one rank."""
    found = Changes([], [], [])

    def note(kind: str, words: str) -> None:
        found.kinds.append(kind)
        found.said.append(words)

    for name in sorted(set(before.identities) | set(after.identities)):
        old, new = before.identities.get(name), after.identities.get(name)
        if old is None or new is None:
            found.replaced.append(name)
            note(f"{name} set", f"{name} {'added' if old is None else 'removed'}")
            continue
        if old != new:
            found.replaced.append(name)
            note(f"{name} layers", f"{name} layers {_differing(old, new)}")
        if before.description[f"{name} adapters"] != after.description[f"{name} adapters"]:
            note(f"{name} adapters", f"{name} adapters now {after.description[f'{name} adapters'].split(', sha')[0]}")
        elif old == new and before.sums[name] != after.sums[name]:
            weights = [key for key, value in after.sums[name].items() if before.sums[name].get(key) != value]
            note(f"{name} weights", f"{name} weights {_names(weights)}")
    if before.description.get("scheduler") != after.description.get("scheduler"):
        note("scheduler", f"scheduler now {after.description.get('scheduler')}")
    return found


def _differing(old: tuple, new: tuple) -> str:
    old_names, new_names = {entry[0]: entry for entry in old}, {entry[0]: entry for entry in new}
    added = [name for name in new_names if name not in old_names]
    removed = [name for name in old_names if name not in new_names]
    swapped = [name for name in new_names if name in old_names and new_names[name] != old_names[name]]
    parts = [
        f"{kind} {_names(names)}"
        for kind, names in (("added", added), ("removed", removed), ("replaced", swapped))
        if names
    ]
    return "; ".join(parts)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")
