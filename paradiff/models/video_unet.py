"""Video U-Nets (AnimateDiff's ``UNetMotionModel``, SVD's ``UNetSpatioTemporalConditionModel``): bands of every frame.

The latent is 5-D — ``(batch, channels, frames, rows, cols)`` (AnimateDiff) or ``(batch, frames, channels,
rows, cols)`` (SVD) — and its rows are the second-to-last dimension either way, as in the 5-D output, so
each rank takes the same row band of every frame. Inside, the model folds the frames into the batch: the
spatial layers see ``(batch * frames, channels, band rows, cols)`` and are banded exactly as in an image
U-Net (halo exchanges on the 3x3 ``Conv2d``, whole-image statistics on the ``GroupNorm``, keys and values
of the spatial self-attention completed to the whole frame). The GroupNorms of AnimateDiff's motion
modules and SVD's temporal resnets see ``(batch, channels, frames, band rows, cols)``: the same banded
statistics apply (the band is equally large on every rank).

The temporal layers act on each pixel's column of frames — motion modules' attention, SVD's
``temporal_transformer_blocks``, the temporal resnets' ``Conv3d`` with kernel ``(3, 1, 1)`` — so they see
only their own band's pixels and need nothing from other ranks: their attention is left out of
:meth:`VideoUNetFamily.self_attention`, and ``Conv3d`` is never banded.

Cut into components (``asyncdiff``) they are the same chain of down, mid and up blocks as an image U-Net.
"""

from __future__ import annotations

from .unet import UNetFamily


class VideoUNetFamily(UNetFamily):
    #: Submodules (by name, any depth) whose attention mixes frames of one pixel, never pixels of a frame.
    temporal_parts: tuple[str, ...] = ()
    #: The 5-D output ``(batch, channels or frames, frames or channels, rows, cols)`` holds the rows at dim 3.
    output_dim = 3

    def self_attention(self, model):
        return [
            (name, module)
            for name, module in super().self_attention(model)
            if not set(name.split(".")) & set(self.temporal_parts)
        ]


class AnimateDiffFamily(VideoUNetFamily):
    name = "animatediff"
    class_names = ("UNetMotionModel",)
    temporal_parts = ("motion_modules",)
    #: The pipeline repeats the prompt for every frame.
    frame_batched_args = ("encoder_hidden_states",)
    #: SparseControlNet residuals: ``(batch * frames, channels, rows, cols)`` maps at each level.
    spatial_residual_args = ("down_block_additional_residuals", "mid_block_additional_residual")


class StableVideoDiffusionFamily(VideoUNetFamily):
    name = "svd"
    class_names = ("UNetSpatioTemporalConditionModel",)
    temporal_parts = ("temporal_transformer_blocks",)
    spatial_residual_args = ()
