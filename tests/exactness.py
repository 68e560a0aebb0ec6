"""The project's one test of "exact": fp32 latents within round-off of one device, the same on every rank.

Decoded images are clamped to [0, 1] and quantisation-sized differences hide under an absolute 1e-4, so
an exact strategy is judged on what the denoising loop produced (the pipeline called with
``output_type="latent"``), relative to the size of the one-device latents: a broken exchange, a stale
layer or a scaled CFG half moves latents by far more than 1e-5 of their largest magnitude.
"""

from __future__ import annotations

import numpy as np
import torch

#: Largest difference allowed, relative to the one-device output's largest magnitude: fp32 round-off.
TOLERANCE = 1e-5


def latents(result) -> np.ndarray:
    """A pipeline output's images (or a video pipeline's frames) as one fp32 array: latents or decoded."""
    output = result.frames if hasattr(result, "frames") else result.images
    if isinstance(output, torch.Tensor):  # latents, maybe bf16 (which numpy has not)
        output = output.detach().float().cpu().numpy()
    return np.asarray(output, dtype=np.float32)


def relative_error(output: np.ndarray, reference: np.ndarray) -> float:
    """``max |output - reference|`` over ``max |reference|``: what :data:`TOLERANCE` bounds."""
    return float(np.abs(output - reference).max()) / float(np.abs(reference).max())


def assert_exact(results: list[dict], what: object = "") -> None:
    """Every rank's ``result["error"]`` (:func:`relative_error` to one device) within :data:`TOLERANCE`, and every
    rank's ``result["output"]`` equal to rank 0's."""
    for rank, result in enumerate(results):
        assert result["error"] <= TOLERANCE, (what, rank, result["error"])
    for rank, result in enumerate(results[1:], start=1):
        np.testing.assert_array_equal(result["output"], results[0]["output"], err_msg=f"{what} rank {rank}")
