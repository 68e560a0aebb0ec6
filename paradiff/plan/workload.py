"""What one denoiser call costs, from the model's shapes alone: FLOPs, and the bytes each strategy would move.

The denoiser is rebuilt from its config on the meta device (no weights, no memory, a fraction of a
second even for a 12B model) and called once on meta tensors shaped as the pipeline's own call. A
``FlopCounterMode`` counts the FLOPs, per unit as well as in total, and forward hooks read the shapes
the strategies exchange:

* the keys and values of every attention layer over image tokens (what ``patch`` gathers, what the
  sequence strategies' all-to-alls carry, what ``pipefusion`` keeps whole);
* the rows a 3×3 (or larger) convolution needs from its neighbours (``patch``'s halos);
* the GroupNorms (one small statistics exchange each under ``patch``);
* the hidden states at the border of every unit of the family's block stack or U-Net components (what
  ``pipefusion``'s stages and ``asyncdiff``'s components pass on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..errors import ParadiffError
from ..models import family_of, find_denoiser
from ..models.base import bind_inputs

CAPTURE_HOOK = "paradiff_plan_capture"
SKIP_HOOK = "paradiff_plan_skip"
#: Steps of every pipeline call the planner makes itself: the fewest that take the pipeline's ordinary path
#: (PixArt with DPM-Solver++ has a one-step path that fails).
PLAN_STEPS = 2


@dataclass(frozen=True)
class Workload:
    """One denoiser call, as the pipeline makes it at one size (both CFG halves when batched)."""

    model: str
    #: Floating-point operations of the call (a multiply-add counts 2).
    flops: float
    #: Operations that launch a kernel (views aside): on a GPU in eager PyTorch, one launch each.
    kernels: int
    #: Bytes of one element of the activations and weights.
    itemsize: int
    #: Parameters of the denoiser, and those of its block stack (what ``pipefusion`` spreads over stages).
    params: int
    stack_params: int
    #: Bytes of the latent the call predicts (what the CFG split and ``parastep`` exchange).
    latent_bytes: float
    #: Keys and values of every attention layer over image tokens, summed over the layers (bytes).
    kv_bytes: float
    attention_layers: int
    #: One row of halo above or below, summed over the convolutions that need neighbours' rows (bytes).
    halo_row_bytes: float
    convolutions: int
    group_norms: int
    #: FLOPs of each unit of the block stack (or of the U-Net's components), in order, and the bytes of
    #: the hidden states each unit passes to the next.
    unit_flops: tuple[float, ...]
    unit_output_bytes: tuple[float, ...]
    #: For each unit, the last unit that reads its output (its successor, or a U-Net up block reading skips).
    unit_last_reader: tuple[int, ...]
    #: Rows of image tokens (latent rows over the patch size): what the strategies cut into bands.
    token_rows: int
    #: The latent's batch in one call (2 for one image with batched CFG).
    batch: int = 1
    #: FLOPs of the self-attention products (scores and weighted values), and the layers' most heads: a head
    #: count Ulysses's ranks do not divide leaves some ranks attending with zero heads.
    attention_flops: float = 0.0
    attention_heads: int = 0
    #: Denoiser calls per step: 1, or 2 for two-call CFG (``flops`` and the bytes are one call's).
    calls_per_step: int = 1

    @property
    def step_flops(self) -> float:
        return self.flops * self.calls_per_step

    def per_step(self) -> Workload:
        """This workload as one step makes it: FLOPs and bytes times the calls per step (shapes and counts alike)."""
        c = self.calls_per_step
        if c == 1:
            return self
        return replace(
            self,
            flops=self.flops * c,
            attention_flops=self.attention_flops * c,
            latent_bytes=self.latent_bytes * c,
            kv_bytes=self.kv_bytes * c,
            halo_row_bytes=self.halo_row_bytes * c,
            unit_flops=tuple(f * c for f in self.unit_flops),
            unit_output_bytes=tuple(b * c for b in self.unit_output_bytes),
        )

    @property
    def stack_flops(self) -> float:
        return sum(self.unit_flops)


class _Captured(Exception):
    """Raised by the capture hook to stop the pipeline call once the denoiser's inputs are known."""


@dataclass
class Capture:
    """The first denoiser call of a pipeline call, and how many calls its first step makes."""

    args: tuple
    kwargs: dict
    timestep: object = None
    calls_per_step: int = 1


class _ZerosHook(ModelHook):
    """Answers every denoiser call with zeros shaped as the meta model's output: nothing is computed."""

    def __init__(self, family, meta: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.family, self.meta, self.dtype = family, meta, dtype
        self.shapes: dict[tuple, torch.Size] = {}

    def zeros(self, module, args: tuple, kwargs: dict) -> Transformer2DModelOutput:
        latent = bind_inputs(module, args, kwargs).arguments[self.family.latent_arg]
        if latent.shape not in self.shapes:
            with torch.no_grad():
                output = self.meta(*on_meta(args, self.dtype), **on_meta(kwargs, self.dtype))
            self.shapes[latent.shape] = output[0].shape
        return Transformer2DModelOutput(sample=latent.new_zeros(self.shapes[latent.shape]))

    def new_forward(self, module, *args, **kwargs):
        return self.zeros(module, args, kwargs)


class _CaptureHook(_ZerosHook):
    """Records the denoiser's first call and answers it with zeros; stops the pipeline call at the second call.
    Two-call CFG (a conditional and an unconditional call per step, as Wan's pipeline makes) shows as a second
    call at the same timestep."""

    def __init__(self, family, meta: nn.Module, dtype: torch.dtype):
        super().__init__(family, meta, dtype)
        self.first: Capture | None = None

    def new_forward(self, module, *args, **kwargs):
        bound = bind_inputs(module, args, kwargs).arguments
        timestep = bound.get(self.family.timestep_arg) if self.family.timestep_arg else None
        if self.first is not None:
            same = timestep is not None and torch.equal(torch.as_tensor(timestep), torch.as_tensor(self.first.timestep))
            self.first.calls_per_step = 2 if same else 1
            raise _Captured
        self.first = Capture(args, kwargs, timestep)
        if timestep is None:
            raise _Captured
        return self.zeros(module, args, kwargs)


@contextlib.contextmanager
def denoiser_skipped(pipe, dtype: torch.dtype | None = None):
    """Inside the block, ``pipe``'s denoiser computes nothing: every call returns zeros of its output's shape (what
    is left of a pipeline call is its prompt encoding, scheduler and decode)."""

    denoiser = find_denoiser(pipe)
    dtype = dtype or next(denoiser.parameters()).dtype
    hook = _ZerosHook(
        family_of(denoiser, any_model=True), meta_model(type(denoiser), dict(denoiser.config), dtype), dtype
    )
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    registry.register_hook(hook, SKIP_HOOK)
    try:
        yield pipe
    finally:
        registry.remove_hook(SKIP_HOOK, recurse=False)


def capture_inputs(denoiser: nn.Module, family, meta: nn.Module, dtype: torch.dtype, call: Callable) -> Capture:
    """The arguments of the first denoiser call ``call()`` makes (a pipeline call of at least 2 steps)."""
    hook = _CaptureHook(family, meta, dtype)
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    registry.register_hook(hook, CAPTURE_HOOK)
    try:
        call()
    except _Captured:
        pass
    finally:
        registry.remove_hook(CAPTURE_HOOK, recurse=False)
    if hook.first is None:
        raise ParadiffError(f"the pipeline call never called its {type(denoiser).__name__}; nothing to plan")
    return hook.first


class _KernelCount(TorchDispatchMode):
    """Counts the operations of a call that compute something: not views (their outputs alias an input), which
    launch nothing. On the meta device attention runs as its math decomposition, a few operations where a GPU
    runs one fused kernel, so the count is a little high."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aliases = any(result.alias_info is not None for result in func._schema.returns)
        self.count += not aliases and func is not torch.ops.aten._unsafe_view.default
        return func(*args, **(kwargs or {}))


def on_meta(value, dtype: torch.dtype):
    """``value`` with every tensor replaced by an empty one on the meta device (floating ones in ``dtype``)."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=dtype if value.is_floating_point() else value.dtype, device="meta")
    if isinstance(value, dict):
        return {key: on_meta(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_meta(item, dtype) for item in value)
    return value


def meta_model(cls: type, config: dict, dtype: torch.dtype) -> nn.Module:
    """The denoiser ``cls`` built from ``config`` on the meta device (no weights are allocated)."""
    with torch.device("meta"):
        model = cls.from_config(config)
    return nn.Module.to(model, dtype).eval()  # nn.Module's: diffusers' own warns about keep-in-float32 modules


def _tensor_bytes(value) -> float:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    if hasattr(value, "sample"):
        return _tensor_bytes(value.sample)
    return 0.0


def trace(
    model: nn.Module, args: tuple, kwargs: dict, token_rows: int, calls_per_step: int = 1, units: list | None = None
) -> Workload:
    """Call ``model`` (on the meta device) once on ``args``/``kwargs`` and read its costs.

    ``units``: ``(name, module)`` of the chain of blocks to cost one by one; by default the family's component
    units (``pipefusion``'s and ``asyncdiff``'s), if it has them.
    """
    family = family_of(model, any_model=True)
    itemsize = next(model.parameters()).element_size()
    kv, products, heads, convs, norms = [], [], [0], [], [0]
    hooks = []
    for _, attn in family.self_attention(model) if family.described else []:
        width = attn.to_k.out_features + attn.to_v.out_features
        heads[0] = max(heads[0], getattr(attn, "heads", 0))

        def read_attention(module, a, k, width=width):
            tokens = (k.get("hidden_states") if "hidden_states" in k else a[0]).shape
            kv.append(tokens[0] * tokens[1] * width * itemsize)
            text = k.get("encoder_hidden_states")  # joint attention: the text tokens attend along
            length = tokens[1] + (0 if text is None else text.shape[1])
            products.append(2 * tokens[0] * length * length * width)  # scores and weighted values: 2·2·B·T²·inner

        hooks.append(attn.register_forward_pre_hook(read_attention, with_kwargs=True))
    for module in model.modules():
        if isinstance(module, nn.Conv2d) and module.kernel_size[0] > module.stride[0]:

            def read_conv(conv, a):
                batch, channels, _, width = a[0].shape
                convs.append(batch * channels * width * (conv.kernel_size[0] // 2) * itemsize)

            hooks.append(module.register_forward_pre_hook(read_conv))
        elif isinstance(module, nn.GroupNorm):
            hooks.append(module.register_forward_pre_hook(lambda *_: norms.__setitem__(0, norms[0] + 1)))
    described = family.component_units(model) if family.described and units is None else None
    units = list(described.units) if described is not None else list(units or [])
    readers = [i + 1 for i in range(len(units))]
    for reader, producers in (described.skips if described is not None else {}).items():
        for producer in producers:
            readers[producer] = max(readers[producer], reader)
    outputs = [0.0] * len(units)
    for index, (_, unit) in enumerate(units):
        hooks.append(unit.register_forward_hook(lambda m, a, out, i=index: outputs.__setitem__(i, _tensor_bytes(out))))
    counter, kernels = FlopCounterMode(display=False), _KernelCount()
    try:
        with counter, kernels, torch.no_grad():
            output = model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    per_module = counter.get_flop_counts()
    unit_flops = tuple(float(sum(per_module.get(f"{type(model).__name__}.{name}", {}).values())) for name, _ in units)
    stack = {id(p) for _, unit in units for p in unit.parameters()}
    latent = bind_inputs(model, args, kwargs).arguments[family.latent_arg]
    return Workload(
        model=type(model).__name__,
        flops=float(counter.get_total_flops()),
        kernels=kernels.count,
        itemsize=itemsize,
        params=sum(p.numel() for p in model.parameters()),
        stack_params=sum(p.numel() for p in model.parameters() if id(p) in stack),
        latent_bytes=_tensor_bytes(output) or latent.numel() * itemsize,
        kv_bytes=float(sum(kv)),
        attention_layers=len(kv),
        halo_row_bytes=float(sum(convs)),
        convolutions=len(convs),
        group_norms=norms[0],
        unit_flops=unit_flops,
        unit_output_bytes=tuple(outputs),
        unit_last_reader=tuple(readers),
        token_rows=token_rows,
        batch=latent.shape[0],
        calls_per_step=calls_per_step,
        attention_flops=float(sum(products)),
        attention_heads=heads[0],
    )


def decode_cost(vae: nn.Module, latent: torch.Tensor) -> tuple[float, int]:
    """FLOPs and kernel-launching operations of ``vae.decode(latent)``, on the meta device."""
    counter, kernels = FlopCounterMode(display=False), _KernelCount()
    with counter, kernels, torch.no_grad():
        vae.decode(latent)
    return float(counter.get_total_flops()), kernels.count


def token_rows_of(model: nn.Module, family, args: tuple, kwargs: dict) -> int:
    """Rows of the grid ``patch`` cuts, read from real (not meta) inputs; latent rows for a family without one."""
    inputs = bind_inputs(model, args, kwargs).arguments
    latent = inputs[family.latent_arg]
    try:
        return family.grid(model, latent, inputs).rows
    except NotImplementedError:
        return latent.shape[-2]


def pipeline_workload(pipe, call: Callable[[], object], dtype: torch.dtype | None = None) -> tuple[Workload, Capture]:
    """The workload of the denoiser calls ``call()`` (a call of ``pipe``) makes, traced on the meta device, and
    the first call's real inputs."""

    denoiser = find_denoiser(pipe)
    family = family_of(denoiser, any_model=True)
    dtype = dtype or next(denoiser.parameters()).dtype
    model = meta_model(type(denoiser), dict(denoiser.config), dtype)
    captured = capture_inputs(denoiser, family, model, dtype, call)
    rows = token_rows_of(denoiser, family, captured.args, captured.kwargs)
    args, kwargs = on_meta(captured.args, dtype), on_meta(captured.kwargs, dtype)
    return trace(model, args, kwargs, rows, captured.calls_per_step), captured
