"""How close each run's images are to the one-device images: PSNR, SSIM and, when available offline, LPIPS.

All through torchmetrics' functional API on images in [0, 1]. LPIPS needs torchvision and the ImageNet
AlexNet weights in torch's hub cache; paradiff never downloads them, it reports why LPIPS was skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torchmetrics.functional.image import (
    learned_perceptual_image_patch_similarity,
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)


def lpips_unavailable_reason() -> str | None:
    """Why LPIPS cannot run here without a download, or None when it can."""
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed (torchmetrics' LPIPS takes its AlexNet backbone from torchvision)"
    import torchvision

    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(torchvision.models.AlexNet_Weights.DEFAULT.url).name
    if not cached.is_file():
        return f"the AlexNet weights are not in torch's hub cache ({cached}) and paradiff downloads nothing"
    return None


def fidelity(images: list[np.ndarray], references: list[np.ndarray], with_lpips: bool) -> list[dict]:
    """Per image pair: ``psnr_db`` (``inf`` when identical), ``ssim`` and ``lpips`` (None without LPIPS)."""
    preds, targets = _batch(images), _batch(references)
    psnr = peak_signal_noise_ratio(preds, targets, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(preds, targets, data_range=1.0, reduction="none")
    lpips = [None] * len(images)
    if with_lpips:
        scores = learned_perceptual_image_patch_similarity(
            preds.float(), targets.float(), net_type="alex", reduction="none", normalize=True
        )
        lpips = [float(score) for score in scores.reshape(-1)]
    return [
        {"psnr_db": float(p), "ssim": float(s), "lpips": score}
        for p, s, score in zip(psnr.tolist(), ssim.tolist(), lpips, strict=True)
    ]


def _batch(images: list[np.ndarray]) -> torch.Tensor:
    """(N, 3, H, W) float64 from N (H, W, 3) arrays; float64 so that tiny round-off differences still count."""
    return torch.from_numpy(np.stack(images).astype(np.float64)).permute(0, 3, 1, 2)
