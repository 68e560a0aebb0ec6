"""What a strategy needs to know about one denoiser family, in one place per family.

A family says where the image's grid of rows enters the denoiser and where it leaves, how its rows
must align, which attention layers mix image tokens, and which layers see row bands. Strategies use
only this interface, never a class name.
"""

from __future__ import annotations

import enum
import inspect
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat import ContextParallelInput, ContextParallelOutput
from ..errors import ParadiffError


@dataclass(frozen=True)
class BlockStack:
    """Where a DiT's transformer blocks are and how one block hands the token streams to the next.

    A pipeline of stages (``pipefusion``) runs the blocks as one sequence, in the order the denoiser's
    forward calls them, and needs nothing else from the model: the embeddings before the blocks and
    the head after them run on every rank.
    """

    #: ``nn.ModuleList`` attributes of the denoiser, in the order its forward runs them.
    lists: tuple[str, ...]
    #: Block argument with the image tokens (whole rows of the grid, row-major).
    image_arg: str = "hidden_states"
    #: Block argument with the text tokens when they flow from block to block (joint attention); the
    #: block then returns both, in the order diffusers records for its class
    #: (:func:`paradiff.compat.block_returns_image_first`). None: the block returns the image tokens,
    #: and any text it attends to is a fixed input (cross-attention).
    text_arg: str | None = None
    #: Block arguments holding a table with one entry per token (rotary position embeddings), each with
    #: where its tokens lie: a ``ContextParallelInput`` (its ``split_dim``; every tensor of a tuple
    #: alike), or a tuple of them and None (entries kept whole) mirroring a tuple argument. A table
    #: longer than the image tokens holds the text tokens' entries first; it is cut to those plus the
    #: patch's, an image-only table to the patch's.
    per_token: dict = field(default_factory=dict)
    #: Denoiser arguments that feed the blocks in ways a pipeline of stages cannot honour.
    unsupported_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ComponentUnits:
    """A denoiser's chain of units (blocks) in forward order, where it can be cut into components (``asyncdiff``).

    Each unit takes its predecessor's output; the code around the units (embeddings, head) runs on every rank.
    """

    #: ``(name, module)`` of every unit, in the order the denoiser's forward runs them.
    units: tuple[tuple[str, nn.Module], ...]
    #: Unit index → earlier units whose outputs it reads besides its predecessor's (U-Net skip features).
    skips: dict[int, frozenset[int]]
    #: Denoiser arguments that feed the units in ways a cut denoiser cannot honour.
    unsupported_args: tuple[str, ...] = ()


#: A plan's spec for the image tokens ``(batch, tokens, channels)``, and for joining them at the output.
IMAGE_TOKENS = ContextParallelInput(split_dim=1, expected_dims=3)
JOINED_TOKENS = ContextParallelOutput(gather_dim=1, expected_dims=3)


@dataclass(frozen=True)
class PromptThenImage:
    """A plan's spec (beside diffusers' ``ContextParallelInput``) for an input holding the prompt's entries,
    then the image tokens', along ``split_dim`` (Chroma's attention mask): the prompt's part stays whole on
    every rank, the image's is cut like the input ``image_arg``, whose length is the image tokens'."""

    split_dim: int
    image_arg: str = "hidden_states"


@dataclass(frozen=True)
class Grid:
    """The image's grid at the place a family splits it: ``rows`` × ``cols`` (latent pixels or tokens)."""

    rows: int
    cols: int


class Capability(enum.Enum):
    """What a family offers the strategies, each derived from what the family declares (its value says which
    declaration). A strategy names the ones it can work with (``Strategy.needs``); whether it runs a family, the
    support matrix and the refusals all follow from the two."""

    ROW_BANDS = "where its image's rows are cut into bands (token_module or cuts_inputs)"
    TOKEN_PLAN = "a plan that cuts its token sequences (split_by_plan)"
    BLOCK_CHAIN = "its transformer blocks as one chain (block_stack)"
    COMPONENTS = "a chain of units to cut into components (block_stack or declares_components)"
    CONTEXT_PARALLEL = "diffusers' context parallelism (context_parallel)"
    FRAME_BLOCKS = "one noise level per frame, run a block of frames at a time (frame_blocks)"


class DenoiserFamily:
    """Base description of a denoiser family (subclasses set the class attributes)."""

    #: Short name used in messages and reports.
    name: str = ""
    #: False only for the stand-in family of a denoiser class no family module describes.
    described: bool = True
    #: Names of the denoiser classes this family covers (matched against the class and its bases).
    class_names: tuple[str, ...] = ()
    #: Name of the forward argument that holds the timestep.
    timestep_arg: str = "timestep"
    #: Name of the forward argument that holds the noisy latent.
    latent_arg: str = "hidden_states"
    #: Tensor arguments whose first dimension is not the batch. A CFG split cuts every other tensor
    #: whose first dimension equals the latent's batch (also inside lists and dicts), so that extra
    #: conditioning (ControlNet residuals, SDXL's ``added_cond_kwargs``) is cut without a list per model.
    unbatched_args: tuple[str, ...] = ()
    #: Tensor arguments whose first dimension is batch × frames, sample by sample (a video U-Net's prompt
    #: repeated per frame): a CFG split cuts them into two contiguous halves.
    frame_batched_args: tuple[str, ...] = ()
    #: Forward arguments holding lists of residuals added to the image tokens (ControlNet's), each ``(batch, image
    #: tokens, channels)`` and whole on every rank: cut like the image tokens, into the rank's rows (``patch``) or
    #: its piece of the sequence (``ulysses``, ``ring``).
    token_residual_args: tuple[str, ...] = ()
    #: Submodule whose output is the image token sequence, sliced to the rank's rows; None: the
    #: family slices the denoiser's inputs itself (:meth:`split_inputs`).
    token_module: str | None = None
    #: Whether :meth:`split_inputs` cuts the denoiser's inputs into the rank's band (what ``patch`` needs of a
    #: family without a token module or a plan).
    cuts_inputs: bool = False
    #: Submodule whose token output is gathered before the model reshapes it; None: the denoiser's
    #: own output is gathered along :attr:`output_dim`.
    output_module: str | None = None
    #: Dimension of the denoiser output (or of ``output_module``'s output) that holds the rows.
    output_dim: int = 1
    #: Whether convolutions and GroupNorms see row bands (U-Nets) and so need halos and global stats.
    banded_spatial_layers: bool = False
    #: When a call's rows cannot be cut into aligned bands: True runs it whole on every rank (same
    #: result, no speedup), False raises :class:`ParadiffError`.
    whole_when_unsplittable: bool = False
    #: Whether the displaced strategies cut the token sequences where :meth:`context_parallel_plan` says,
    #: into one contiguous piece per rank, and complete every self-attention's keys and values where
    #: ``scaled_dot_product_attention`` is called (``paradiff.layers.sdpa_kv``). Then neither
    #: :attr:`token_module` nor :meth:`split_inputs` is used.
    split_by_plan: bool = False
    #: Submodule that embeds the prompt before the blocks, on the prompt alone (PixArt's caption projection): a
    #: forward that ``pipefusion`` runs around the blocks, to work out a call's patches ahead, reuses its output
    #: for the call instead of embedding the prompt again (``paradiff.layers.prompt_projection``). None: none.
    prompt_embedder: str | None = None
    #: With :attr:`split_by_plan`: whether prompt tokens, whole on every rank (the plan does not split
    #: them), join the image tokens inside self-attention: True before them, False after them; None: the
    #: self-attention sees only tokens the plan splits.
    joint_text_first: bool | None = None

    def grid(self, model: nn.Module, latent: torch.Tensor, inputs: dict) -> Grid:
        """Rows × cols of the grid that is cut into bands, for this call's latent."""
        raise NotImplementedError

    def row_multiple(self, model: nn.Module) -> int:
        """Rows of the grid in one band must be a multiple of this (strides at every level)."""
        return 1

    def pixels_per_row(self, model: nn.Module, vae_scale_factor: int) -> int:
        """Image pixels per row of the grid (for messages that name a height that works)."""
        return vae_scale_factor

    def split_inputs(self, model: nn.Module, inputs: dict, rows: slice, grid: Grid) -> None:
        """Slice the denoiser's inputs in place to the rank's band (for families without a token module)."""

    #: Names of the attention layers whose keys and values come from the image tokens (``*`` stands for any
    #: one part of a name: ``transformer_blocks.*.attn1``); empty: every attention layer that says it is not
    #: cross-attention.
    attention_layers: tuple[str, ...] = ()

    def self_attention(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Attention layers whose keys and values come from the image tokens."""
        if self.attention_layers:
            return [(name, model.get_submodule(name)) for name in modules_matching(model, self.attention_layers)]
        return [
            (name, module)
            for name, module in model.named_modules()
            if hasattr(module, "to_k") and hasattr(module, "is_cross_attention") and not module.is_cross_attention
        ]

    # Exact sequence parallelism through diffusers' context parallelism (strategies "ulysses", "ring").

    #: Whether the family can run under diffusers' context parallelism.
    context_parallel: bool = False
    #: Forward argument whose tokens the context-parallel plan splits besides the image's (joint
    #: attention: text and image tokens attend to each other); None: text stays whole on every rank.
    context_parallel_text_arg: str | None = None

    #: Whether the processors of :meth:`self_attention` call PyTorch's ``scaled_dot_product_attention``
    #: themselves: under diffusers' context parallelism each such call is handed to diffusers' dispatcher.
    context_parallel_sdpa: bool = False
    #: Forward arguments holding a mask over prompt tokens that the context-parallel plan cuts (diffusers'
    #: Ulysses must then extend it over the keys it gathers, which older releases do not).
    context_parallel_mask_args: tuple[str, ...] = ()

    def context_parallel_plan(self, model: nn.Module) -> dict | None:
        """diffusers' plan (module name → where the sequence is split or gathered); None: this diffusers has none."""
        return None

    def split_plan(self, model: nn.Module) -> dict | None:
        """With :attr:`split_by_plan`: where the displaced strategies cut and join the tokens (the same
        format); by default :meth:`context_parallel_plan`. A family whose prompt tokens stay whole on
        every rank under the displaced strategies (cheaper: nothing about the prompt is exchanged) leaves
        them out here."""
        return self.context_parallel_plan(model)

    def context_parallel_processors(self, model: nn.Module) -> list[tuple[nn.Module, object]]:
        """``(attention layer, processor)`` to install first: layers whose processor would attend to local tokens only.

        Raises :class:`ParadiffError` for a processor that cannot run under diffusers' context parallelism.
        """
        return []

    # Pipelines of stages (strategy "pipefusion").

    #: The blocks a pipeline of stages cuts; None: the family cannot run as one.
    block_stack: BlockStack | None = None
    #: Whether :meth:`component_units` names units of its own (a U-Net's down, mid and up blocks) rather than
    #: the block stack's (what ``asyncdiff`` cuts into components).
    declares_components: bool = False

    def block_inputs(self, model: nn.Module, image_tokens: int, text_tokens: int) -> dict:
        """Arguments of one block call with random tokens (batch 1), to time each kind of block."""
        raise NotImplementedError

    def component_units(self, model: nn.Module) -> ComponentUnits | None:
        """The units a cut into components (``asyncdiff``) works on: the block stack; None: the family has none."""
        stack = self.block_stack
        if stack is None:
            return None
        units = tuple((f"{name}.{i}", block) for name in stack.lists for i, block in enumerate(getattr(model, name)))
        return ComponentUnits(units, {}, stack.unsupported_args)

    # Blocks of frames at their own noise levels (strategy "dualparal").

    #: How to run one block of frames at a time (``paradiff.models.skyreels_v2.FrameBlocks``) for a video DiT that
    #: takes one noise level per frame (diffusion forcing); None: the family cannot.
    frame_blocks = None

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What this family's declarations let strategies do (nothing for the stand-in of an undescribed class)."""
        if not self.described:
            return frozenset()
        declared = {
            Capability.ROW_BANDS: self.token_module is not None or self.cuts_inputs,
            Capability.TOKEN_PLAN: self.split_by_plan,
            Capability.BLOCK_CHAIN: self.block_stack is not None,
            Capability.COMPONENTS: self.block_stack is not None or self.declares_components,
            Capability.CONTEXT_PARALLEL: self.context_parallel,
            Capability.FRAME_BLOCKS: self.frame_blocks is not None,
        }
        return frozenset(capability for capability, offered in declared.items() if offered)

    def displaced_processor(self, attn: nn.Module, kv_factory):
        """A processor that completes K/V itself (rotary models); None: hook ``to_k``/``to_v`` instead."""
        return None

    def matches(self, model: nn.Module) -> bool:
        return any(cls.__name__ in self.class_names for cls in type(model).__mro__)


def modules_matching(model: nn.Module, patterns: tuple[str, ...] | str) -> list[str]:
    """Names of ``model``'s submodules that match ``patterns``, in ``named_modules`` order (``*``: one name part)."""
    patterns = (patterns,) if isinstance(patterns, str) else patterns
    regexes = [re.compile(re.escape(p).replace(r"\*", r"[^.]+")) for p in patterns]
    return [name for name, _ in model.named_modules() if name and any(r.fullmatch(name) for r in regexes)]


def bind_inputs(model: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The denoiser call's arguments by name (from the class's ``forward``, whatever hooks wrap it)."""
    signature = inspect.signature(type(model).forward)
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature.bind(*args, **kwargs)


def slice_rows(tensor: torch.Tensor, dim: int, rows: slice, cols: int = 1) -> torch.Tensor:
    """The rows ``rows`` of ``tensor`` along ``dim``, where each row spans ``cols`` entries of that dim."""
    return tensor.narrow(dim, rows.start * cols, (rows.stop - rows.start) * cols)


def random_tokens(model: nn.Module, *shape: int) -> torch.Tensor:
    """Random activations in the model's device and dtype (for timing blocks; the values do not matter)."""
    return torch.randn(*shape, device=model.device, dtype=model.dtype)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ParadiffError(message)


class PatchTokensFamily(DenoiserFamily):
    """A DiT whose image tokens are the latent's patches, frame by frame, row by row, cut by a plan.

    The grid's rows are frames × rows of patches: whole rows of the image (or video) in token order, so
    a piece of the grid's rows is a contiguous piece of the tokens.
    """

    split_by_plan = True
    #: The block whose ``hidden_states`` (the image tokens) the plan cuts, to be joined again at ``proj_out``;
    #: None: the plan is :meth:`context_parallel_plan` (diffusers' own).
    tokens_enter: str | None = None
    #: The rest of the plan: per-token inputs (rotary tables) cut alike.
    per_token_plan: dict = {}
    #: Dimension of the latent holding the frames (video DiTs; ``patch_size_t`` of them per token);
    #: None: an image latent, or a video DiT cut along the rows of each frame (Latte).
    frames_dim: int | None = None

    @staticmethod
    def patch(model: nn.Module) -> tuple[int, int]:
        """``(frames, rows)`` of latent pixels per token, from the config (``patch_size`` an int or a 3-tuple)."""
        patch = model.config.patch_size
        if isinstance(patch, (tuple, list)):
            return patch[0], patch[1]
        return getattr(model.config, "patch_size_t", None) or 1, patch

    def grid(self, model, latent, inputs):
        frames_per_token, patch = self.patch(model)
        frames = 1 if self.frames_dim is None else -(-latent.shape[self.frames_dim] // frames_per_token)
        return Grid(rows=frames * (latent.shape[-2] // patch), cols=latent.shape[-1] // patch)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * self.patch(model)[1]

    def split_plan(self, model):
        if self.tokens_enter is None:
            return super().split_plan(model)
        return {**self.per_token_plan, self.tokens_enter: {"hidden_states": IMAGE_TOKENS}, "proj_out": JOINED_TOKENS}

    def context_parallel_plan(self, model):
        """The displaced strategies' plan, with the prompt cut too where it joins the image tokens in attention
        (:attr:`context_parallel_text_arg`): diffusers' Ulysses and ring attend over whatever every rank holds."""
        if self.tokens_enter is None or not self.context_parallel:
            return super().context_parallel_plan(model)
        plan = self.split_plan(model)
        if self.context_parallel_text_arg:
            plan[self.tokens_enter] = {**plan[self.tokens_enter], self.context_parallel_text_arg: IMAGE_TOKENS}
        return plan


def map_by_spec(value, spec, cut):
    """``value`` with ``cut(tensor, spec)`` applied where a plan's spec says: a tensor by its spec; a tuple or
    list element-wise, by the one spec given for every element (a rotary table's ``(cos, sin)``) or by a tuple of
    specs mirroring the value (``None`` keeps an element whole: Allegro's ``((freqs...), (grids...))`` takes
    ``(None, (grid, grid, grid))``); anything else as it is."""
    if spec is None:
        return value
    if isinstance(value, torch.Tensor):
        return cut(value, spec) if isinstance(spec, ContextParallelInput) else value
    if isinstance(value, (tuple, list)):
        specs = spec if isinstance(spec, (tuple, list)) else (spec,) * len(value)
        require(len(specs) == len(value), f"a plan gives {len(specs)} specs for an input of {len(value)} parts")
        return type(value)(map_by_spec(v, s, cut) for v, s in zip(value, specs, strict=True))
    return value


def rotary_outputs(dims: int = 2) -> dict:
    """A plan's entry for a module returning a rotary table ``(cos, sin)``, one row per image token along dim 0."""
    table = ContextParallelInput(split_dim=0, expected_dims=dims, split_output=True)
    return {0: table, 1: table}


def rotary_input(dims: int = 2) -> tuple:
    """A plan's spec for an input holding a rotary table ``(cos, sin)``, one row per image token along dim 0."""
    table = ContextParallelInput(split_dim=0, expected_dims=dims)
    return (table, table)
