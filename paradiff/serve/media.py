"""Pictures as the bytes a reply carries: PNG, JPEG or WebP images, MP4 videos (encoded on rank 0)."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np

from .card import VIDEO_FPS

#: The formats an image reply may take (``output_format``), and PIL's name for each.
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image(picture: np.ndarray, output_format: str) -> bytes:
    """An image ``(H, W, 3)`` in [0, 1] as ``output_format`` bytes (rounded to 8 bits as diffusers does)."""
    from diffusers.utils import numpy_to_pil

    buffer = io.BytesIO()
    numpy_to_pil(picture[None])[0].save(buffer, format=IMAGE_FORMATS[output_format])
    return buffer.getvalue()


def encode_video(frames: np.ndarray) -> bytes:
    """Frames ``(F, H, W, 3)`` in [0, 1] as an MP4 file's bytes (through diffusers' ``export_to_video``)."""
    from diffusers.utils import export_to_video

    with tempfile.TemporaryDirectory(prefix="paradiff-video-") as folder:
        path = Path(folder) / "video.mp4"
        export_to_video(list(frames), str(path), fps=VIDEO_FPS)
        return path.read_bytes()


def encode(pictures: np.ndarray, output_format: str) -> list[bytes]:
    """Each image or video of ``pictures`` (``(B, H, W, 3)`` or ``(B, F, H, W, 3)``) as bytes."""
    if output_format == "mp4":
        return [encode_video(video) for video in pictures]
    return [encode_image(image, output_format) for image in pictures]
