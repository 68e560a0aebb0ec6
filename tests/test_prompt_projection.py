"""The cache of a cross-attention's prompt projections: the same output for the same, unchanged input in one call."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from diffusers.hooks import HookRegistry
from torch import nn

from paradiff.layers.prompt_projection import PromptProjectionHook, prompt_projections
from paradiff.runtime.step_state import StepState


def _hooked() -> tuple[nn.Linear, StepState]:
    torch.manual_seed(0)
    layer, state = nn.Linear(4, 3), StepState(warmup_steps=0)
    HookRegistry.check_if_exists_or_initialize(layer).register_hook(
        PromptProjectionHook(SimpleNamespace(state=state), "layer"), "cache"
    )
    state.begin_run()
    state.enter_call(None, 999)
    return layer, state


def test_the_same_input_in_one_call_is_projected_once():
    layer, state = _hooked()
    prompt = torch.randn(2, 5, 4)
    first = layer(prompt)
    assert layer(prompt) is first
    torch.testing.assert_close(first, nn.functional.linear(prompt, layer.weight, layer.bias), rtol=0, atol=0)


def test_an_equal_input_laid_out_alike_is_projected_once():
    layer, state = _hooked()
    prompt = torch.randn(2, 5, 4)
    first = layer(prompt)
    assert layer(prompt.clone()) is first  # equal values, another tensor
    transposed = prompt.transpose(0, 1).contiguous().transpose(0, 1)  # equal values, other strides
    assert layer(transposed) is not first


def test_an_input_equal_to_what_the_kept_one_became_is_projected_again():
    layer, state = _hooked()
    prompt = torch.randn(2, 5, 4)
    kept = layer(prompt)
    prompt.add_(1)  # the input kept, edited in place after its projection
    assert layer(prompt.clone()) is not kept


def test_another_input_an_edited_one_or_another_call_is_projected_again():
    layer, state = _hooked()
    prompt = torch.randn(2, 5, 4)
    first = layer(prompt)
    assert layer(prompt + 1e-3) is not first
    kept = layer(prompt)
    prompt.mul_(2)  # edited in place
    assert torch.equal(layer(prompt), nn.functional.linear(prompt, layer.weight, layer.bias))
    kept = layer(prompt)
    state.enter_call(None, 998)  # the next step
    assert layer(prompt) is not kept
    kept = layer(prompt)
    state.begin_run()  # the next pipe(...) call
    state.enter_call(None, 999)
    assert layer(prompt) is not kept


def test_only_the_prompt_projections_of_cross_attention_are_found():
    from diffusers.models.attention_processor import Attention

    self_attention = Attention(query_dim=8, heads=2, dim_head=4)
    cross_attention = Attention(query_dim=8, cross_attention_dim=6, heads=2, dim_head=4)
    found = prompt_projections([("attn1", self_attention), ("attn2", cross_attention)])
    assert [name for name, _ in found] == ["attn2.to_k", "attn2.to_v"]
    assert [layer for _, layer in found] == [cross_attention.to_k, cross_attention.to_v]
