"""How close each run's images or videos are to the one-device ones: PSNR, SSIM and, when available offline, LPIPS.

PSNR and SSIM come from :mod:`paradiff.metrics` for images and video frames alike: its SSIM is torchmetrics'
figure, computed with a separable window in numpy, where torchmetrics' float64 convolution on the CPU costs
seconds per image (the bench scores every image of every run). Videos are scored frame by frame, since a single
bad frame matters in a video: each frame's PSNR and SSIM, their mean and worst, and the flicker of both videos.
LPIPS, from torchmetrics, needs torchvision (the build for this torch) and the ImageNet AlexNet weights in torch's
hub cache; paradiff never downloads them, it reports why LPIPS was skipped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torchmetrics.functional.image import learned_perceptual_image_patch_similarity

from ..metrics import frame_changes, psnr, ssim


def lpips_unavailable_reason() -> str | None:
    """Why LPIPS cannot run here without a download, or None when it can."""
    if importlib.util.find_spec("torchvision") is None:
        return (
            "torchvision is not installed; torchmetrics' LPIPS takes its AlexNet backbone from torchvision, "
            f"which must be the build made for this torch ({torch.__version__}; PyPI's Linux wheels are CUDA "
            "builds that do not load beside a CPU torch), with the ImageNet AlexNet weights in torch's hub cache"
        )
    try:
        import torchvision
    except Exception as error:  # e.g. a CUDA build beside a CPU torch: "operator torchvision::nms does not exist"
        return f"torchvision does not import beside torch {torch.__version__}: {' '.join(str(error).split())}"
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(torchvision.models.AlexNet_Weights.DEFAULT.url).name
    if not cached.is_file():
        return f"the ImageNet AlexNet weights are not in torch's hub cache ({cached}) and paradiff downloads nothing"
    return None


def fidelity(images: list[np.ndarray], references: list[np.ndarray], with_lpips: bool) -> list[dict]:
    """Per image pair: ``psnr_db`` (``inf`` when identical), ``ssim`` and ``lpips`` (None without LPIPS)."""
    lpips = _lpips(_batch(images), _batch(references)) if with_lpips else [None] * len(images)
    return [
        {"psnr_db": psnr(image, reference), "ssim": ssim(image, reference), "lpips": score}
        for image, reference, score in zip(images, references, lpips, strict=True)
    ]


def _batch(images: list[np.ndarray]) -> torch.Tensor:
    """(N, 3, H, W) from N (H, W, 3) arrays, as LPIPS takes them."""
    return torch.from_numpy(np.stack(images).astype(np.float32)).permute(0, 3, 1, 2)


def video_fidelity(videos: list[np.ndarray], references: list[np.ndarray], with_lpips: bool) -> list[dict]:
    """Per (F, H, W, 3) video pair: each frame's ``psnr_db`` and ``ssim`` (in ``frames``), their mean and worst
    (``psnr_db_worst``, ``ssim_worst``, ``worst_frame``: the 0-based frame of lowest SSIM), ``lpips`` (the mean
    over frames, or None), and ``flicker`` and ``flicker_one_device``: the mean absolute frame-to-frame change
    of the video and of the one-device video, with ``changes`` and ``changes_one_device`` per frame step.
    """
    scores = []
    for video, reference in zip(videos, references, strict=True):
        if video.shape != reference.shape:
            raise ValueError(f"a video of shape {video.shape} cannot be compared with one of {reference.shape}")
        frame_psnr = [psnr(frame, ref) for frame, ref in zip(video, reference, strict=True)]
        frame_ssim = [ssim(frame, ref) for frame, ref in zip(video, reference, strict=True)]
        changes, changes_one_device = frame_changes(video), frame_changes(reference)
        lpips = _lpips(_batch(list(video)), _batch(list(reference))) if with_lpips else None
        scores.append(
            {
                "psnr_db": float(np.mean(frame_psnr)),
                "psnr_db_worst": min(frame_psnr),
                "ssim": float(np.mean(frame_ssim)),
                "ssim_worst": min(frame_ssim),
                "worst_frame": int(np.argmin(frame_ssim)),
                "lpips": None if lpips is None else float(np.mean(lpips)),
                "flicker": float(changes.mean()) if len(changes) else 0.0,
                "flicker_one_device": float(changes_one_device.mean()) if len(changes) else 0.0,
                "frames": {"psnr_db": frame_psnr, "ssim": frame_ssim},
                "changes": changes.tolist(),
                "changes_one_device": changes_one_device.tolist(),
            }
        )
    return scores


def _lpips(preds: torch.Tensor, targets: torch.Tensor) -> list[float]:
    scores = learned_perceptual_image_patch_similarity(
        preds, targets, net_type="alex", reduction="none", normalize=True
    )
    return [float(score) for score in scores.reshape(-1)]
