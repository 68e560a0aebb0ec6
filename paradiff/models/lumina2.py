"""Lumina-Image 2.0 (``Lumina2Transformer2DModel``): refiners, then joint layers over prompt and image tokens.

Only cut into components (``asyncdiff``): the joint ``layers`` run in turn, each taking and returning
the joint sequence (the mask, the rotary table and the time embedding are fixed inputs), so they form a
chain; the patch embedding, the two refiners (``noise_refiner`` over the image tokens, ``context_refiner``
over the prompt) and the head run on every rank.

Not cut into pieces of tokens (``patch``, ``pipefusion``): the forward builds the joint sequence per
sample, from each prompt's valid tokens, then the image tokens and padding up to the batch's longest,
with a rotary table built the same way, and takes the image tokens back out by those lengths; none of
that has a place where one rank's piece of the image could enter and leave.
"""

from __future__ import annotations

from .base import ComponentUnits, DenoiserFamily


class Lumina2Family(DenoiserFamily):
    declares_components = True
    name = "lumina2"
    class_names = ("Lumina2Transformer2DModel",)

    def component_units(self, model):
        return ComponentUnits(tuple((f"layers.{i}", layer) for i, layer in enumerate(model.layers)), {})
