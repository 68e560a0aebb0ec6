"""paradiff.compat: the one place paradiff reads diffusers' internals, checked against the installed diffusers."""

from __future__ import annotations

import diffusers
import pytest
import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxTransformerBlock
from torch import nn

from paradiff.compat import (
    CallContextName,
    DispatchedAttentionProcessor,
    active_attention_backend,
    block_returns_image_first,
    clear_parallel_config,
    context_parallel_backend_available,
    context_parallel_backends,
    flux_qkv_projections,
    invalidate_hook_cache,
    parallel_config_of,
    recording_parallel_config,
    remove_hook,
)
from paradiff.models.base import BlockStack
from paradiff.stages.blocks import PassThroughHook, block_streams


class NameRecorder(ModelHook):
    """A stateful hook that records the call context name it sees at every call."""

    _is_stateful = True

    def __init__(self):
        super().__init__()
        self.context = CallContextName()
        self.seen = []

    def pre_forward(self, module, *args, **kwargs):
        self.seen.append(self.context.name)
        return args, kwargs

    def reset_state(self, module):
        return module


class TwoLayers(ModelMixin, CacheMixin):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)
        self.processor = None

    def forward(self, x):
        return self.second(self.first(x))


def test_call_context_name_follows_cache_context():
    model, early, late = TwoLayers(), NameRecorder(), NameRecorder()
    HookRegistry.check_if_exists_or_initialize(model.first).register_hook(early, "early")
    invalidate_hook_cache(model)
    with model.cache_context("cond"):
        model(torch.ones(1, 2))
    HookRegistry.check_if_exists_or_initialize(model.second).register_hook(late, "late")
    invalidate_hook_cache(model)  # diffusers >= 0.40 would hand "uncond" to a stale list of hooks without it
    with model.cache_context("uncond"):
        model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert early.seen == ["cond", "uncond", None], diffusers.__version__
    assert late.seen == ["uncond", None]


def test_remove_hook_removes_this_module_only():
    model = TwoLayers()
    for module in (model, model.first):
        HookRegistry.check_if_exists_or_initialize(module).register_hook(NameRecorder(), "paradiff.test")
    remove_hook(model, "paradiff.test")
    remove_hook(model.second, "paradiff.test")  # never hooked: nothing to do
    assert "paradiff.test" not in model._diffusers_hook.hooks
    assert "paradiff.test" in model.first._diffusers_hook.hooks


class CogVideoXLike(CogVideoXBlock):
    """An unregistered subclass: takes its order from the nearest registered base."""


@pytest.mark.parametrize(
    ("block_class", "image_first"),
    [
        (CogVideoXBlock, True),
        (CogVideoXLike, True),
        (FluxTransformerBlock, False),
        (JointTransformerBlock, False),  # unregistered before diffusers 0.41: the default order
        (nn.Linear, False),
    ],
)
def test_block_output_order(block_class, image_first):
    assert block_returns_image_first(block_class) is image_first


def test_pass_through_keeps_a_reversed_order_block_order():
    """CogVideoX's blocks return ``(image, text)``: a block the stage skips must hand them on in that order."""
    torch.manual_seed(0)
    block = CogVideoXBlock(dim=8, num_attention_heads=2, attention_head_dim=4, time_embed_dim=8)
    image, text, temb = torch.randn(1, 6, 8), torch.randn(1, 3, 8), torch.randn(1, 8)
    stock = block(image, text, temb)
    assert stock[0].shape == image.shape and stock[1].shape == text.shape  # the stock order: image first
    assert block_streams(block, stock) == (stock[0], stock[1])
    HookRegistry.check_if_exists_or_initialize(block).register_hook(
        PassThroughHook(BlockStack(lists=("transformer_blocks",), text_arg="encoder_hidden_states")), "pass"
    )
    handed_on = block(image, text, temb)
    assert handed_on[0] is image and handed_on[1] is text


def test_attention_backends():
    assert "native" in context_parallel_backends()
    assert context_parallel_backends() == sorted(context_parallel_backends())
    assert context_parallel_backend_available("native")
    assert not context_parallel_backend_available("no-such-backend")
    assert active_attention_backend() == "native"
    model = TwoLayers()
    model.processor = DispatchedAttentionProcessor()
    assert active_attention_backend(model) == "native"
    model.processor._attention_backend = "_native_math"  # this instance only, unlike set_attention_backend
    assert active_attention_backend(model) == "_native_math"


def test_dispatched_attention_is_attention():
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 5, 3, 4) for _ in range(3))
    out = DispatchedAttentionProcessor().dispatch(query, key, value, parallel=False)
    expected = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value))).transpose(1, 2)
    torch.testing.assert_close(out, expected.flatten(2, 3))


def test_flux_qkv_projections():
    attn = FluxAttention(query_dim=8, heads=2, dim_head=4, added_kv_proj_dim=8)
    image, text = torch.randn(1, 6, 8), torch.randn(1, 3, 8)
    query, key, value, text_query, text_key, text_value = flux_qkv_projections(attn, image, text)
    torch.testing.assert_close(query, attn.to_q(image))
    torch.testing.assert_close(text_value, attn.add_v_proj(text))


def test_parallel_config_is_recorded_for_the_call_only_and_cleared():
    model, config = TwoLayers(), object()
    model.processor = DispatchedAttentionProcessor()
    with recording_parallel_config(model, config):
        assert model._resolve_parallel_config("ignored") is config
        model.processor._parallel_config = config  # as enable_parallelism hands it on
    assert "_resolve_parallel_config" not in vars(model)
    assert parallel_config_of(model) is config
    clear_parallel_config(model, config)
    assert parallel_config_of(model) is None and model.processor._parallel_config is None
    assert "_parallel_config" not in vars(model) and "_parallel_config" not in vars(model.processor)
