"""``paradiff.tiny``'s table: every family paradiff describes has a pipeline in it, and every entry builds the same
weights and call from the same seed, makes what its kind says, and leaves the caller's RNG alone."""

from __future__ import annotations

import pytest
import torch

from paradiff import tiny
from paradiff.loading import makes_video
from paradiff.models import FAMILIES, family_of, find_denoiser


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for key, value in component.state_dict().items()
    }


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, torch.Generator):
        return torch.equal(a.get_state(), b.get_state())
    if hasattr(a, "tobytes"):  # a PIL image
        return a.tobytes() == b.tobytes()
    return a == b


@pytest.mark.parametrize("name", tiny.names())
def test_an_entry_builds_the_same_weights_and_call_from_the_same_seed(name):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    pipe, call = tiny.build(name)
    assert torch.equal(torch.rand(3), expected), "the build left the caller's global RNG as it was"
    again, call_again = tiny.build(name)
    weights, weights_again = _weights(pipe), _weights(again)
    assert weights.keys() == weights_again.keys()
    assert all(torch.equal(weights[key], weights_again[key]) for key in weights)
    assert call.keys() == call_again.keys() and all(_equal(call[key], call_again[key]) for key in call)
    reseeded = _weights(tiny.pipeline(name, seed=1))
    assert any(not torch.equal(weights[key], reseeded[key]) for key in weights if weights[key].is_floating_point())
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert not any(m.training for c in modules for m in c.modules()), "every model in eval mode"
    assert makes_video(pipe) == (tiny.TABLE[name].kind == "video"), "the kind says what the pipeline makes"
    assert call["num_inference_steps"] >= 2  # a one-step call takes another path in some pipelines


def test_every_family_paradiff_describes_has_a_tiny_pipeline():
    described = {type(family_of(find_denoiser(tiny.pipeline(name)), any_model=True)) for name in tiny.names()}
    missing = {type(family).__name__ for family in FAMILIES} - {cls.__name__ for cls in described}
    assert not missing, f"families without a tiny pipeline in paradiff.tiny.TABLE: {sorted(missing)}"


def test_names_by_kind_and_group():
    assert set(tiny.names(kind="image")) | set(tiny.names(kind="video")) == set(tiny.TABLE)
    assert not set(tiny.names(kind="image")) & set(tiny.names(kind="video"))
    assert tiny.names(group="classic") == (*tiny.FAMILIES, *(f"{family}-bench" for family in tiny.FAMILIES))
    assert tiny.names(kind="video", group="forcing") == ("skyreels-df",)
    with pytest.raises(ValueError, match="unknown kind 'audio'; the kinds are image, video"):
        tiny.names(kind="audio")
    with pytest.raises(ValueError, match=r"unknown tiny pipeline 'nope'; the table holds sd, sdxl, "):
        tiny.build("nope")
