"""Hooks that run a diffusion-forcing video DiT one frame block at a time through a pipeline of stages (``dualparal``).

A denoiser call of the diffusion-forcing pipeline carries the whole window of latent frames, each at
its own noise level. :class:`WindowHook` runs the stock forward once per frame block that the call
needs (the blocks in flight, whose prediction the pipeline uses, and a finished block whose boundary
keys and values no rank holds yet), each time on that block's frames and levels only, so no tensor of
the whole video's tokens is ever built: not the activations, not the per-token modulation, not the
model's block-causal mask over every pair of tokens.

Inside each block's forward the stages pass it on (:class:`StageEntryHook`: receive from the previous
stage, run this rank's blocks, send to the next), the rotary table keeps the block's frame positions in
the window (:class:`RotaryOffsetHook`), and each self-attention of this rank's blocks (:class:`TailKVHook`)
attends to the block's own tokens plus the keys and values of the last ``context`` frames of the
block before it (the feature cache), then keeps its own last frames' keys and values for the next block.
The model's block-causal mask lets a block see every earlier block; this window sees the previous one's
last frames only, which is what keeps each rank's memory to the blocks in flight.

Which keys and values of the previous block a block reads, and which blocks a call runs, is decided per
call by :class:`FrameSchedule` (``paradiff.strategies.dualparal``): this module only moves the tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from ..compat import CallContextHook
from ..layers.sdpa import SDPAHook
from ..layers.split import output_sample, replace_output_sample
from ..models.base import BlockStack, bind_inputs
from .blocks import block_output
from .link import StageLink

#: One layer's kept keys and values: ``(keys, values)``, each ``(batch, heads, tokens, head_dim)``.
TailKV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class BlockPass:
    """The frame block a forward is running now: where its frames are, what it reads and what it keeps."""

    #: Its place among the call's passes (the message index between stages).
    index: int
    #: The block's number in the window and its first latent frame there.
    block: int
    first_frame: int
    #: Tokens of the frames whose keys and values the next block reads (the last ``context`` frames).
    tail_tokens: int
    #: The previous block's kept keys and values by layer name; None: the block attends to itself only.
    reads: dict[str, TailKV] | None
    #: Where this block's own kept keys and values go, by layer name.
    keeps: dict[str, TailKV] = field(default_factory=dict)


class BlockCursor:
    """What the hooks of one denoiser share: the pass running now and this call's link between stages."""

    def __init__(self):
        self.current: BlockPass | None = None
        self.link: StageLink | None = None


class WindowHook(CallContextHook):
    """On the denoiser: runs the stock forward once per frame block the call needs, and assembles the output.

    ``plan(module, inputs, context)`` says which blocks the call runs, in order, as :class:`BlockPass`es,
    how many latent frames a block has, which window frames get a prediction (a contiguous range) and
    the stage link; ``finish(context)`` is told when they have run.
    """

    def __init__(self, latent_arg: str, timestep_arg: str, cursor: BlockCursor, plan: Callable, finish: Callable):
        super().__init__()
        self.latent_arg, self.timestep_arg, self.cursor = latent_arg, timestep_arg, cursor
        self.plan, self.finish = plan, finish

    def new_forward(self, module, *args, **kwargs):
        bound = bind_inputs(module, args, kwargs)
        inputs = bound.arguments
        latent, timestep = inputs[self.latent_arg], inputs[self.timestep_arg]
        passes, frames, predicted, link = self.plan(module, inputs, self.context.name)
        self.cursor.link = link
        outputs: dict[int, torch.Tensor] = {}
        output = None
        try:
            for one in passes:
                self.cursor.current = one
                span = slice(one.first_frame, one.first_frame + frames)
                inputs[self.latent_arg] = latent[:, :, span]
                inputs[self.timestep_arg] = timestep[:, span]
                output = self.fn_ref.original_forward(*bound.args, **bound.kwargs)
                outputs[one.block] = output_sample(output)
            link.finish()
        finally:
            self.cursor.current = None
        first, stop = predicted
        blocks = range(first // frames, stop // frames)
        region = torch.cat([outputs[block] for block in blocks], dim=2).contiguous()
        link.share_output(region)  # the last stage's prediction, to every rank
        sample = region.new_zeros(*region.shape[:2], latent.shape[2], *region.shape[3:])
        sample[:, :, first:stop] = region
        self.finish(self.context.name)
        return replace_output_sample(output, sample)


class RotaryOffsetHook(ModelHook):
    """On the rotary-embedding module: the table of the current block's frames at their place in the window."""

    def __init__(self, cursor: BlockCursor, rotary_at: Callable):
        super().__init__()
        self.cursor, self.rotary_at = cursor, rotary_at

    def new_forward(self, module, latent, *args, **kwargs):
        current = self.cursor.current
        if current is None:
            return self.fn_ref.original_forward(latent, *args, **kwargs)
        return self.rotary_at(module, latent, current.first_frame)


class StageEntryHook(ModelHook):
    """On the first block of this rank's stage: the block pass arrives from the previous stage, runs this rank's
    blocks and leaves for the next one. ``forwards()`` gives the stage's blocks' own forwards, in order."""

    def __init__(self, stack: BlockStack, cursor: BlockCursor, forwards: Callable[[], list[Callable]]):
        super().__init__()
        self.stack, self.cursor, self.forwards = stack, cursor, forwards

    def new_forward(self, module, *args, **kwargs):
        bound = bind_inputs(module, args, kwargs)
        inputs, link = bound.arguments, self.cursor.link
        index = self.cursor.current.index
        tokens = inputs[self.stack.image_arg]
        if not link.first:
            tokens = link.receive(index).view_as(tokens)
        for forward in self.forwards():
            inputs[self.stack.image_arg] = tokens
            tokens = forward(*bound.args, **bound.kwargs)
        if not link.last:
            link.send(index, tokens)
        return block_output(self.stack, module, tokens, None)


class TailKVHook(SDPAHook):
    """On one self-attention of this rank's stage: attends to the previous block's kept keys and values too.

    The stock processor computes the block's queries, keys and values (norms and rotary table included);
    the kept keys and values of the previous block's last frames go in front of the block's own, in frame
    order. The mask is dropped: the forward runs one causal block, which the model's mask lets see all of
    itself, and the previous block's frames are wholly visible to it.
    """

    def __init__(self, name: str, cursor: BlockCursor):
        super().__init__(name)
        self.cursor = cursor

    def attend(self, call, query, key, value, options):
        current = self.cursor.current
        tail = current.tail_tokens
        current.keeps[self.name] = (key[..., -tail:, :].clone(), value[..., -tail:, :].clone())
        if current.reads is not None:
            kept_key, kept_value = current.reads[self.name]
            key, value = torch.cat([kept_key, key], dim=-2), torch.cat([kept_value, value], dim=-2)
        options["attn_mask"] = None
        return F.scaled_dot_product_attention(query, key, value, **options)
