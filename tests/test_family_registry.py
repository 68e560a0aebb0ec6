"""Denoiser families are declared capabilities, and a family registered from outside paradiff is used.

A family's capabilities follow from what it declares (``cuts_inputs``, ``declares_components``,
``block_stack``, ...), a strategy names the capabilities it needs, and ``supports``, the support matrix and
refusals follow from the two. ``register_family`` adds a family that is
tried before the built-in ones, so it may describe a subclass of a class they cover.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import PixArtTransformer2DModel

import paradiff
from paradiff.errors import ParadiffError
from paradiff.models import FAMILIES, AnyDenoiserFamily, Capability, family_of, register_family, unregister_family
from paradiff.models.base import DenoiserFamily
from paradiff.models.dit import PixArtFamily
from paradiff.strategies import BUILTIN_NAMES, strategy_class
from paradiff.strategies.base import Strategy
from paradiff.strategies.support import strategies_for, supported_classes
from paradiff.tiny import build_pipeline, prompt_inputs


def test_the_built_in_families_declare_what_they_implement():
    for family in FAMILIES:
        kind = type(family)
        assert family.cuts_inputs == (kind.split_inputs is not DenoiserFamily.split_inputs), family.name
        assert family.declares_components == (kind.component_units is not DenoiserFamily.component_units), family.name


def test_a_strategy_runs_the_families_that_offer_a_capability_it_needs():
    for name in BUILTIN_NAMES:
        strategy = strategy_class(name)
        for family in (*FAMILIES, AnyDenoiserFamily()):
            offered = not family.capabilities.isdisjoint(strategy.needs) or (family.described and not strategy.needs)
            assert strategy.supports(family) == (strategy.model_agnostic or offered), (name, family.name)
    pixart = next(family for family in FAMILIES if family.name == "pixart")
    assert {Capability.ROW_BANDS, Capability.BLOCK_CHAIN, Capability.COMPONENTS} <= pixart.capabilities
    assert AnyDenoiserFamily().capabilities == frozenset()

    class ChainOnly(Strategy):
        name = "chain-only"
        needs = (Capability.BLOCK_CHAIN,)

    assert supported_classes(ChainOnly) == supported_classes(strategy_class("pipefusion"))


class MyDiT(PixArtTransformer2DModel):
    """A user's own denoiser class (here a PixArt subclass, so that a tiny pipeline runs it)."""


class MyDiTFamily(PixArtFamily):
    """PixArt's description without its block stack: this family cannot run as a pipeline of stages."""

    name = "my-dit"
    class_names = ("MyDiT",)
    block_stack = None


def _my_pipeline():
    pipe = build_pipeline("pixart")
    pipe.transformer.__class__ = MyDiT
    return pipe


def test_a_registered_family_describes_its_class_and_its_declarations_decide_the_strategies():
    pipe = _my_pipeline()
    assert family_of(pipe.transformer).name == "pixart", "a subclass of a covered class: the built-in family"
    register_family(MyDiTFamily())
    try:
        family = family_of(pipe.transformer)
        assert isinstance(family, MyDiTFamily), "registered families are tried first"
        assert "'patch'" in strategies_for(family) and "'pipefusion'" not in strategies_for(family)
        paradiff.check_parallelize(pipe, "patch", world_size=2, height=64)
        assert Capability.BLOCK_CHAIN not in family.capabilities
        refusal = r"pipefusion' does not support MyDiT: it needs .* \(block_stack\), which the my-dit family does not"
        with pytest.raises(ParadiffError, match=refusal):
            paradiff.check_parallelize(pipe, "pipefusion", world_size=2, height=64)
        with pytest.raises(ParadiffError, match="a denoiser family named 'my-dit' exists"):
            register_family(MyDiTFamily())
    finally:
        unregister_family("my-dit")
    assert family_of(pipe.transformer).name == "pixart"
    with pytest.raises(ParadiffError, match="built-in families cannot be removed"):
        unregister_family("pixart")


def _patch_under_my_family() -> dict:
    pipe = _my_pipeline()
    inputs = {**prompt_inputs(pipe, "pixart"), "height": 64, "width": 64, "num_inference_steps": 3}
    register_family(MyDiTFamily())
    try:
        alone = pipe(**inputs, generator=torch.Generator().manual_seed(0), output_type="latent").images
        paradiff.parallelize(pipe, strategy="patch", warmup_steps=3)
        family = type(family_of(pipe.transformer)).__name__
        split = pipe(**inputs, generator=torch.Generator().manual_seed(0), output_type="latent").images
        paradiff.unparallelize(pipe)
    finally:
        unregister_family("my-dit")
    return {"alone": alone.numpy(), "split": split.numpy(), "family": family}


@pytest.mark.timeout(120)
def test_patch_runs_a_registered_family_exactly_at_2_ranks(pool2):
    results = pool2.run(_patch_under_my_family)
    for result in results:
        assert result["family"] == "MyDiTFamily"
        scale = np.abs(result["alone"]).max()
        assert np.abs(result["split"] - result["alone"]).max() <= 1e-5 * scale
    np.testing.assert_array_equal(results[0]["split"], results[1]["split"])
