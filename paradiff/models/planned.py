"""A transformer class no family module describes, for which diffusers ships a context-parallel plan.

diffusers' ``_cp_plan`` says where the class's token sequences are cut and where they are joined,
which is all the displaced strategies need besides the attention layers; so such a class runs under
``patch`` (and ``ulysses``/``ring``, through diffusers itself) without a family module.

Which attention layers are completed. Every attention layer (a module with an attention processor)
except those that declare themselves cross-attention (``is_cross_attention``). Completing a layer whose
keys every rank holds whole (a cross-attention that does not say so) stays exact: full attention over
N identical copies of the same keys and values gives the same output, at the cost of the exchange.
What would not be exact is a layer that joins tokens the plan keeps whole to tokens it splits; the
shipped plans split everything that enters such a layer, as diffusers' own Ulysses needs too.
"""

from __future__ import annotations

import inspect

from torch import nn

from ..compat import shipped_context_parallel_plan
from .base import DenoiserFamily, Grid


class PlannedDiTFamily(DenoiserFamily):
    name = "planned"
    split_by_plan = True
    context_parallel = True

    def __init__(self, model: nn.Module | None = None):
        if model is not None:
            self.class_names = (type(model).__name__,)
            parameters = list(inspect.signature(type(model).forward).parameters)[1:]
            self.latent_arg = parameters[0]
            self.timestep_arg = "timestep" if "timestep" in parameters else None

    @staticmethod
    def describes(model: nn.Module) -> bool:
        return shipped_context_parallel_plan(model) is not None

    @staticmethod
    def _patch(model) -> int:
        patch = getattr(model.config, "patch_size", None) or 1
        return patch[-1] if isinstance(patch, (tuple, list)) else patch

    def grid(self, model, latent, inputs):
        if latent.dim() >= 4:  # a latent image or video: rows and columns of patches
            patch = self._patch(model)
            return Grid(rows=latent.shape[-2] // patch, cols=latent.shape[-1] // patch)
        return Grid(rows=latent.shape[1], cols=1)  # packed tokens: their number is what must divide

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * self._patch(model)

    def context_parallel_plan(self, model):
        return shipped_context_parallel_plan(model)

    def self_attention(self, model):
        return [
            (name, module)
            for name, module in model.named_modules()
            if hasattr(module, "processor") and not getattr(module, "is_cross_attention", False)
        ]
