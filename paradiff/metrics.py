"""Fidelity of a parallel image or video against the one-device output with the same seed.

Plain numpy, so that the core install (without the ``bench`` extra) can score its own outputs. SSIM
follows Wang et al. (2004) with the usual constants (11-pixel Gaussian window of σ 1.5, K1 0.01,
K2 0.03), computed as torchmetrics' ``structural_similarity_index_measure`` computes it (the image
reports' SSIM), so that video frames and images are scored on one scale.
"""

from __future__ import annotations

import numpy as np

#: SSIM's Gaussian window: its width in pixels and its standard deviation.
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
#: SSIM's stabilising constants, as fractions of the data range.
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def psnr(image: np.ndarray, reference: np.ndarray, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB (``inf`` for identical images); images in ``[0, data_range]``."""
    mse = float(np.mean((np.asarray(image, np.float64) - np.asarray(reference, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * float(np.log10(data_range**2 / mse))


def ssim_window() -> np.ndarray:
    """The normalised 1-D Gaussian weights; the 2-D window is their outer product (it is separable)."""
    offsets = np.arange(SSIM_WINDOW) - SSIM_WINDOW // 2
    weights = np.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    return weights / weights.sum()


def ssim(image: np.ndarray, reference: np.ndarray, data_range: float = 1.0) -> float:
    """Structural similarity of two (H, W) or (H, W, C) images in ``[0, data_range]``: 1 when identical.

    Local means, variances and the covariance are Gaussian-weighted over the 11×11 window around every
    pixel, the image mirrored at its border (without repeating the edge) where the window reaches out;
    the score is the mean of the SSIM map over every pixel and channel.
    """
    x = np.asarray(image, np.float64)
    y = np.asarray(reference, np.float64)
    if x.shape != y.shape:
        raise ValueError(f"SSIM compares images of one shape, got {x.shape} and {y.shape}")
    reach = SSIM_WINDOW // 2
    if min(x.shape[:2]) <= reach:
        raise ValueError(
            f"SSIM mirrors an image {reach} px out at its border, which needs images of at least "
            f"{reach + 1}×{reach + 1} px, got {x.shape[0]}×{x.shape[1]}"
        )
    weights = ssim_window()
    border = [(reach, reach), (reach, reach)] + [(0, 0)] * (x.ndim - 2)

    def local_mean(values: np.ndarray) -> np.ndarray:
        padded = np.pad(values, border, mode="reflect")
        rows = np.lib.stride_tricks.sliding_window_view(padded, SSIM_WINDOW, axis=0) @ weights
        return np.lib.stride_tricks.sliding_window_view(rows, SSIM_WINDOW, axis=1) @ weights

    mu_x, mu_y = local_mean(x), local_mean(y)
    # round-off can leave a variance a hair below zero on flat regions
    var_x = np.maximum(local_mean(x * x) - mu_x**2, 0.0)
    var_y = np.maximum(local_mean(y * y) - mu_y**2, 0.0)
    cov = local_mean(x * y) - mu_x * mu_y
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    score = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(score.mean())


def frame_changes(frames: np.ndarray) -> np.ndarray:
    """Mean absolute change from each frame of an (F, H, W[, C]) video to the next: F - 1 values.

    Their mean is the video's flicker; set beside the one-device video's, it tells whether a
    parallel strategy made frames jump where the one-device run moved smoothly.
    """
    video = np.asarray(frames, np.float64)
    return np.abs(np.diff(video, axis=0)).reshape(len(video) - 1, -1).mean(axis=1)
