"""Work on the prompt alone, done once per denoiser call instead of once per patch or forward (``pipefusion``).

``pipefusion`` passes a call's image tokens through each stage in M patches, and every patch's cross-attention
projects the same prompt tokens to keys and values again: M times the work one device does once per call; and
the forwards around the blocks that work out the next call's patches ahead embed the prompt again (the family's
``prompt_embedder``, PixArt's caption projection). This hook on such a module (``to_k``, ``to_v``, ...; the prompt
embedder) keeps its output for the call in progress and hands it out again for an input equal to the one it was
computed on, bit for bit and laid out alike (the same tensor for the patches of a call; an equal one from a
forward around the blocks), so the result is the one the module would compute. Comparing costs a read of the
prompt tokens, a small part of projecting them. Any other call computes as usual. Under ``torch.compile`` the
hook computes every time (the comparison is no graph's business).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks import ModelHook
from torch import nn

from ..runtime.comm import Communicator

#: The projections of a cross-attention layer whose input is the prompt (the image-prompt ones of Wan I2V too).
PROMPT_PROJECTIONS = ("to_k", "to_v", "add_k_proj", "add_v_proj")


@dataclass
class _Kept:
    """One projection's output for one call: the step it belongs to, the input it was computed on and its version."""

    step: int = -1
    source: torch.Tensor | None = None
    version: int = -1
    output: torch.Tensor | None = None

    def holds(self, step: int, source: torch.Tensor) -> bool:
        """Whether the output kept is the one for ``source`` at ``step``."""
        kept = self.source
        if self.step != step or kept is None or kept._version != self.version:  # edited in place since: not it
            return False
        if kept is source:
            return True
        return (
            kept.dtype == source.dtype
            and kept.shape == source.shape
            and kept.stride() == source.stride()
            and torch.equal(kept, source)
        )


class PromptProjectionHook(ModelHook):
    """On a module that works on the prompt alone: the call's output again for an input equal to the one kept.

    What is kept lives in the step state's per-call-slot buffers, so it is dropped at the end of each ``pipe(...)``
    call, and work done ahead for the next call (``as_call``) keeps that call's own.
    """

    def __init__(self, comm: Communicator, name: str):
        super().__init__()
        self.comm, self.name = comm, name

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        if torch.compiler.is_compiling() or len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return forward(*args, **kwargs)
        source, state = args[0], self.comm.state
        kept = state.exchange(self.name, _Kept)
        if kept.holds(state.step, source):
            return kept.output
        output = forward(source)
        kept.step, kept.source, kept.version, kept.output = state.step, source, source._version, output
        return output


def prompt_projections(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Linear]]:
    """``(name, projection)`` of every prompt projection of the cross-attention layers among the named ``modules``."""
    return [
        (f"{name}.{attribute}", projection)
        for name, module in modules
        if getattr(module, "is_cross_attention", False)
        for attribute in PROMPT_PROJECTIONS
        if isinstance(projection := getattr(module, attribute, None), nn.Linear)
    ]
