"""U-Nets (``UNet2DConditionModel``: SD 1.x/2.x, SDXL): the latent is split into row bands at the input.

Cut into components (``asyncdiff``), a U-Net is the chain down blocks → mid block → up blocks. Each down
block appends its resnets' (and down-sampler's) outputs to the stack of skip features, and each up block
pops as many as it has resnets; :meth:`UNetFamily.component_units` derives from these counts which down
blocks each up block reads. The first skip feature (``conv_in``'s output) comes from no unit: it is
computed with the embeddings on every rank.
"""

from __future__ import annotations

from .base import ComponentUnits, DenoiserFamily, Grid, slice_rows


class UNetFamily(DenoiserFamily):
    declares_components = True
    cuts_inputs = True
    name = "unet"
    class_names = ("UNet2DConditionModel",)
    latent_arg = "sample"
    output_dim = 2
    banded_spatial_layers = True
    #: ControlNet/T2I-adapter residuals are spatial maps at each level: sliced like the latent.
    spatial_residual_args = (
        "down_block_additional_residuals",
        "mid_block_additional_residual",
        "down_intrablock_additional_residuals",
    )

    def grid(self, model, latent, inputs):
        return Grid(rows=latent.shape[-2], cols=latent.shape[-1])

    def row_multiple(self, model):
        # every down-sampling level halves the band; it must stay aligned with the stride at each level
        return 2**model.num_upsamplers

    def component_units(self, model):
        names = [f"down_blocks.{i}" for i in range(len(model.down_blocks))]
        names += ["mid_block"] if model.mid_block is not None else []
        names += [f"up_blocks.{i}" for i in range(len(model.up_blocks))]
        units = tuple((name, model.get_submodule(name)) for name in names)
        producers: list[int | None] = [None]  # conv_in's output
        for index, block in enumerate(model.down_blocks):
            producers += [index] * (len(block.resnets) + len(block.downsamplers or ()))
        skips = {}
        for index, block in enumerate(model.up_blocks, start=len(names) - len(model.up_blocks)):
            popped, producers = producers[-len(block.resnets) :], producers[: -len(block.resnets)]
            skips[index] = frozenset(p for p in popped if p is not None)
        return ComponentUnits(units, skips, self.spatial_residual_args)

    def split_inputs(self, model, inputs, rows, grid):
        inputs[self.latent_arg] = slice_rows(inputs[self.latent_arg], -2, rows)
        for arg in self.spatial_residual_args:
            value = inputs.get(arg)
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                inputs[arg] = type(value)(_slice_level(t, rows, grid) for t in value)
            else:
                inputs[arg] = _slice_level(value, rows, grid)


def _slice_level(tensor, rows, grid):
    factor = grid.rows // tensor.shape[-2]
    return slice_rows(tensor, -2, slice(rows.start // factor, rows.stop // factor))
