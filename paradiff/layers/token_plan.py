"""Hooks that cut a DiT's token sequences into one contiguous piece per rank, following a context-parallel plan.

A plan is diffusers' ``_cp_plan`` format (module name → where its inputs or outputs are split, or
where its output is gathered), shipped by diffusers with the class or declared in the family module.
diffusers applies such a plan for its own sequence parallelism; the displaced strategies apply it
here with paradiff's communicator, so that the split follows the call's step state and the gather
ends the call (and sends the call's displaced data). Same semantics as diffusers': a tensor whose
number of dimensions differs from ``expected_dims`` is left whole. One extension: the spec of a
tuple input may itself be a tuple of specs (or ``None``) that mirrors the value's structure, for
inputs where only some parts are per token (``paradiff.models.base.map_by_spec``); and ``PromptThenImage`` cuts only
the image part of an input that also holds the prompt's entries.
"""

from __future__ import annotations

from functools import partial

import torch
from diffusers.hooks import ModelHook

from ..compat import CallContextHook, ContextParallelInput, ContextParallelOutput
from ..errors import ParadiffError
from ..models.base import DenoiserFamily, PromptThenImage, bind_inputs, map_by_spec, modules_matching
from ..runtime.comm import Communicator
from .sdpa_kv import JointText
from .split import output_sample, replace_output_sample


def split_piece(tensor: torch.Tensor, spec: ContextParallelInput, comm: Communicator, where: str) -> torch.Tensor:
    """This rank's contiguous piece of ``tensor`` along ``spec.split_dim``."""
    if spec.expected_dims is not None and tensor.dim() != spec.expected_dims:
        return tensor
    length = tensor.shape[spec.split_dim]
    if length % comm.size:
        raise ParadiffError(
            f"the {length} tokens of {where} do not divide into {comm.size} equal pieces; choose a height, width "
            f"(or frame count, prompt length) that gives a multiple of {comm.size} tokens, or a strategy that cuts "
            "no tokens (strategy='parastep', 'asyncdiff' or 'cfg')"
        )
    piece = length // comm.size
    return tensor.narrow(spec.split_dim, comm.rank * piece, piece)


def _split_inputs(module, args, kwargs, specs: dict, comm: Communicator, where: str, text: JointText):
    """``args, kwargs`` with the tensors ``specs`` names (by position or name) cut to this rank's piece.

    The piece of ``hidden_states`` (diffusers' name for the image tokens) is the rank's image tokens.
    """
    bound = bind_inputs(module, args, kwargs)
    names, whole = list(bound.signature.parameters), dict(bound.arguments)
    for key, spec in specs.items():
        name = names[key] if isinstance(key, int) else key
        value, what = bound.arguments.get(name), f"{where} input '{name}'"
        if isinstance(spec, PromptThenImage) and isinstance(value, torch.Tensor):
            image = whole[spec.image_arg].shape[1]
            prompt, image_part = value.split([value.shape[spec.split_dim] - image, image], dim=spec.split_dim)
            piece = split_piece(image_part, ContextParallelInput(split_dim=spec.split_dim), comm, what)
            bound.arguments[name] = torch.cat([prompt, piece], dim=spec.split_dim)
            continue
        bound.arguments[name] = map_by_spec(value, spec, partial(split_piece, comm=comm, where=what))
        if name == "hidden_states" and isinstance(value, torch.Tensor):
            text.image_tokens = bound.arguments[name].shape[1]
    return bound.args, bound.kwargs


def _splits_output(spec) -> bool:
    """Whether ``spec`` cuts an output (a tuple of specs for a nested input never does)."""
    return isinstance(spec, ContextParallelInput) and spec.split_output


def _split_outputs(output, specs: dict, comm: Communicator, where: str):
    if isinstance(output, torch.Tensor):
        return split_piece(output, specs[0], comm, f"{where} output")
    pieces = list(output)
    for index, spec in specs.items():
        pieces[index] = split_piece(pieces[index], spec, comm, f"{where} output {index}")
    return type(output)(pieces)


class PlanSplitHook(ModelHook):
    """On a module the plan names: split its inputs, or its outputs, or gather its output back whole."""

    def __init__(self, comm: Communicator, where: str, spec, text: JointText):
        super().__init__()
        self.comm, self.where, self.text = comm, where, text
        self.gather = spec if isinstance(spec, ContextParallelOutput) else None
        specs = {} if self.gather else spec
        self.inputs = {k: s for k, s in specs.items() if not _splits_output(s)}
        self.outputs = {k: s for k, s in specs.items() if _splits_output(s)}

    def pre_forward(self, module, *args, **kwargs):
        if not self.inputs:
            return args, kwargs
        return _split_inputs(module, args, kwargs, self.inputs, self.comm, f"'{self.where}'", self.text)

    def post_forward(self, module, output):
        if self.gather is not None:
            return self.comm.end_call(output, self.gather.gather_dim)
        return _split_outputs(output, self.outputs, self.comm, f"'{self.where}'") if self.outputs else output


class PlannedCallHook(CallContextHook):
    """On the denoiser: counts the step, splits the denoiser's own inputs the plan names (its ``""`` entry).

    When the plan gathers the denoiser's own output (``""`` → ``ContextParallelOutput``), it does so here too.
    """

    def __init__(
        self, family: DenoiserFamily, comm: Communicator, spec: dict | ContextParallelOutput | None, text: JointText
    ):
        super().__init__()
        self.family, self.comm, self.text = family, comm, text
        self.gather = spec if isinstance(spec, ContextParallelOutput) else None
        self.inputs = spec if isinstance(spec, dict) else {}

    def pre_forward(self, module, *args, **kwargs):
        inputs = bind_inputs(module, args, kwargs).arguments
        family = self.family
        self.comm.state.enter_call(self.context.name, inputs[family.timestep_arg] if family.timestep_arg else 0)
        self.comm.state.partition = None
        self.text.image_tokens = None
        if not self.inputs:
            return args, kwargs
        return _split_inputs(module, args, kwargs, self.inputs, self.comm, "the denoiser", self.text)

    def post_forward(self, module, output):
        if self.gather is None:
            return output
        return replace_output_sample(output, self.comm.end_call(output_sample(output), self.gather.gather_dim))


def plan_hooks(
    model, family: DenoiserFamily, plan: dict, comm: Communicator, text: JointText
) -> list[tuple[object, ModelHook]]:
    """``(module, hook)`` for every module ``plan`` names, the denoiser's own first (``text`` learns the image tokens).

    ``*`` in a name stands for any one part of a module's name (``transformer_blocks.*``): each module it
    matches gets the entry, merged with any entry naming it exactly.
    """
    specs: dict[str, dict | ContextParallelOutput] = {}
    for pattern, spec in plan.items():
        for name in modules_matching(model, pattern) if pattern else ():
            merged = specs.get(name)
            specs[name] = {**merged, **spec} if isinstance(merged, dict) and isinstance(spec, dict) else spec
    hooks = [(model, PlannedCallHook(family, comm, plan.get(""), text))]
    return hooks + [(model.get_submodule(name), PlanSplitHook(comm, name, spec, text)) for name, spec in specs.items()]
