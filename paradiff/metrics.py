"""Fidelity of a parallel image against the one-device image with the same seed."""

from __future__ import annotations

import numpy as np


def psnr(image: np.ndarray, reference: np.ndarray, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB (``inf`` for identical images); images in ``[0, data_range]``."""
    mse = float(np.mean((np.asarray(image, np.float64) - np.asarray(reference, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * float(np.log10(data_range**2 / mse))
