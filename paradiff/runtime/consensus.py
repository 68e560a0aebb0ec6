"""Ranks must run the same job: checked once at ``parallelize`` and again at every ``pipe(...)`` call.

Ranks that disagree fail in the worst ways: a different prompt or guidance scale gives a silently wrong
image, a different size aborts one rank inside gloo, a different step count or strategy hangs until
the timeout. So before any other collective the ranks compare a description of what they are about to
run — at ``parallelize`` the pipeline (each component's class, parameter count and a checksum of its
weights) and the options, at each call every argument of the call — and a mismatch raises
:class:`~paradiff.errors.ParadiffError` on every rank, naming the argument and the ranks that differ.

A description maps names to short strings that carry everything compared (tensors and images by
dtype, shape and a hash of their content). The ranks exchange a 16-byte digest of it; only when the
digests differ do they exchange the descriptions themselves, to say what differs.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..errors import ParadiffError
from .comm import Communicator
from .model_watch import describe_scheduler, modules_of
from .weights import combined, named_tensors, tensor_sums

#: Strings longer than this are shown cut, followed by a hash of the whole.
SHOWN_CHARS = 60
#: Mismatching names listed in one error at most.
SHOWN_MISMATCHES = 3


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().view(-1)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def describe(value, content: bool = True) -> str:
    """A short string that differs whenever ``value`` differs (``content=False``: its kind and shape only)."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        if len(value) <= SHOWN_CHARS:
            return repr(value)
        return f"{value[:SHOWN_CHARS]!r}… (sha {_hash(value.encode())})"
    if isinstance(value, torch.Tensor):
        shown = f"{str(value.dtype).removeprefix('torch.')} tensor {tuple(value.shape)} on {value.device.type}"
        return f"{shown}, sha {_hash(_tensor_bytes(value))}" if content else shown
    if isinstance(value, torch.Generator):
        return f"generator on {value.device.type}"
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array {value.shape}, sha {_hash(np.ascontiguousarray(value).tobytes())}"
    if hasattr(value, "tobytes") and hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"{value.mode} image {value.size}, sha {_hash(value.tobytes())}"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(describe(item, content) for item in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{key}: {describe(item, content)}' for key, item in sorted(value.items()))}}}"
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return type(value).__qualname__


#: Arguments each rank may give differently: paradiff makes them agree from rank 0's (``runtime.agree``),
#: so only their kind and shape must match.
AGREED_FROM_RANK_0 = ("generator", "latents")


def describe_call(signature: inspect.Signature, pipe, args: tuple, kwargs: dict) -> dict[str, str]:
    """Every argument of one ``pipe(...)`` call (defaults filled in), plus the pipeline's dtype and device kind."""
    try:
        bound = signature.bind(pipe, *args, **kwargs)
    except TypeError as error:
        raise ParadiffError(f"{type(pipe).__name__}(...) cannot take these arguments: {error}") from error
    bound.apply_defaults()
    arguments = dict(list(bound.arguments.items())[1:])  # without self
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    description = {name: describe(value, name not in AGREED_FROM_RANK_0) for name, value in arguments.items()}
    description["pipeline dtype"] = str(getattr(pipe, "dtype", None))
    description["device kind"] = getattr(getattr(pipe, "device", None), "type", "none")
    return description


def weights_checksum(module: nn.Module, names: tuple[str, ...] | None = None) -> float:
    """A float64 checksum of ``module``'s parameters and buffers (only those ``names`` gives, if given), computed
    where they lie, quantized ones included (:mod:`paradiff.runtime.weights`)."""
    named = named_tensors(module)
    tensors = list(named.values()) if names is None else [named[name] for name in names]
    return combined(tensor_sums(tensors))


def describe_setup(pipe, options: dict, loaded_stage: Callable[[nn.Module], object | None]) -> dict[str, str]:
    """What ``parallelize`` runs: the options, the pipeline class, each component (class, parameter count,
    dtype, weights checksum). ``loaded_stage(module)`` says which stage of a component's blocks this rank
    loaded (``paradiff.stages.load_stage``), None for a whole one: then the ranks compare the cut instead."""
    description = {name: describe(value) for name, value in options.items()}
    description["pipeline"] = type(pipe).__qualname__
    scheduler = describe_scheduler(pipe)
    if scheduler is not None:
        description["scheduler"] = scheduler
    for name, module in modules_of(pipe).items():
        count = sum(p.numel() for p in module.parameters())
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
        description[name] = f"{type(module).__qualname__}, {count:,} parameters ({'/'.join(dtypes)})"
        held = loaded_stage(module)
        if held is None:
            description[f"{name} weights"] = f"checksum {weights_checksum(module):.10e}"
        else:  # each rank holds another stage of the blocks: compare the cut and what every rank holds
            shared = weights_checksum(module, held.shared)
            description[f"{name} weights"] = f"stages {list(held.stages)} loaded by stage, checksum {shared:.10e}"
    return description


def agree(description: dict[str, str], comm: Communicator, subject: str, fix: str) -> None:
    """Return if every rank of ``comm`` passed the same ``description``, else raise on every rank.

    ``subject`` names what is compared ("the call's arguments"), ``fix`` how to make the ranks agree.
    """
    blob = json.dumps(description, sort_keys=True).encode()
    mine = torch.frombuffer(bytearray(hashlib.sha256(blob).digest()[:16]), dtype=torch.int64).to(comm.device)
    everyone = [torch.empty_like(mine) for _ in range(comm.size)]
    comm.wait([comm.all_gather(everyone, mine)[0]])
    if all(torch.equal(other, mine) for other in everyone):
        return
    descriptions = comm.all_gather_object(description)
    raise ParadiffError(f"ranks disagree on {subject}: {disagreement(descriptions)}; {fix}")


def disagreement(descriptions: list[dict[str, str]]) -> str:
    """Which names differ between the ranks' descriptions and what each rank has, e.g.
    ``guidance_scale differs: 7.5 (ranks 0, 2), 5.0 (rank 1)``."""
    names = list(dict.fromkeys(name for description in descriptions for name in description))
    differing = [name for name in names if len({d.get(name) for d in descriptions}) > 1]
    clauses = [_clause(name, [d.get(name, "not given") for d in descriptions]) for name in differing]
    more = len(clauses) - SHOWN_MISMATCHES
    return "; ".join(clauses[:SHOWN_MISMATCHES]) + (f"; and {more} more" if more > 0 else "")


def _clause(name: str, values: list[str]) -> str:
    ranks_by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks_by_value.setdefault(value, []).append(rank)
    return f"{name} differs: {', '.join(f'{value} ({_ranks(ranks)})' for value, ranks in ranks_by_value.items())}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
