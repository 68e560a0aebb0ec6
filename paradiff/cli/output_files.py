"""Where ``paradiff generate`` writes its pictures, and how, so that no output is lost or half-written.

Several pictures (several prompts, ``num_images_per_prompt``) go to numbered files beside ``--out``
(``circle-1.png``, ``circle-2.png``), or into ``--out`` when it is a folder. A file that exists is
replaced only when asked (``--overwrite``): the check runs before anything is drawn. Each file is
written to a temporary name in its own folder and renamed over the target, so that a write that fails
(a full disk) leaves the earlier file whole and no truncated picture behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ..errors import ParadiffError, ParadiffWarning

#: What ``--out`` may end in, per output kind (``.jpeg`` and ``.tif`` spellings included).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".gif")
DEFAULT_OUT = {"image": "paradiff.png", "video": "paradiff.mp4"}


def output_kind(out: str | None) -> str | None:
    """``"image"``, ``"video"`` or None (no file named) by the file's extension; a :class:`ParadiffError` if unknown."""
    if out is None or is_folder(out):
        return None
    suffix = Path(out).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    raise ParadiffError(
        f"--out {out}: paradiff writes images as {', '.join(IMAGE_SUFFIXES)} and videos as {', '.join(VIDEO_SUFFIXES)}"
    )


def is_folder(out: str) -> bool:
    """Whether ``--out`` names a folder to write into: one that exists, or a name ending in a separator."""
    return out.endswith(("/", os.sep)) or Path(out).expanduser().is_dir()


def output_paths(out: str | None, kind: str, count: int) -> list[Path]:
    """The files ``count`` pictures of ``kind`` go to: ``--out`` itself for one, numbered beside it for more."""
    if out is None:
        target = Path(DEFAULT_OUT[kind])
    elif is_folder(out):
        target = Path(out).expanduser() / DEFAULT_OUT[kind]
    else:
        target = Path(out).expanduser()
    if count == 1:
        return [target]
    return [target.with_name(f"{target.stem}-{number}{target.suffix}") for number in range(1, count + 1)]


def check_writable(paths: list[Path], overwrite: bool) -> None:
    """Refuse files that exist (unless ``overwrite``) and folders that are missing or not writable."""
    for folder in dict.fromkeys(path.absolute().parent for path in paths):
        if not folder.is_dir():
            raise ParadiffError(f"cannot write {paths[0]}: folder {folder} does not exist")
        try:  # tried for real: permissions, a read-only disk
            fd, probe = tempfile.mkstemp(prefix=".paradiff-", dir=folder)
        except OSError as error:
            raise ParadiffError(f"cannot write {paths[0]}: {error.strerror or error}") from error
        os.close(fd)
        os.unlink(probe)
    for path in paths:
        if path.is_dir():
            raise ParadiffError(f"--out {path} is a folder; name a file")
        if path.exists() and not overwrite:
            raise ParadiffError(f"{path} exists; pass --overwrite to replace it, or name another --out")


def write_outputs(outputs: np.ndarray, paths: list[Path]) -> list[str]:
    """Write each image ``(H, W, 3)`` or video ``(F, H, W, 3)`` of ``outputs`` to its path; returns the paths.

    A picture of the other kind than its file (checked before drawing, so it should not happen) goes to
    the default name of its kind beside it, with a warning, rather than be lost.
    """
    written = []
    for output, path in zip(outputs, paths, strict=True):
        video = output.ndim == 4
        if (output_kind(str(path)) == "video") != video:
            fallback = path.with_name(Path(DEFAULT_OUT["video" if video else "image"]).name)
            made = "a video" if video else "an image"
            warnings.warn(f"the pipeline made {made}: writing {fallback}", ParadiffWarning, stacklevel=2)
            path = fallback
        _write_atomically(output, path)
        written.append(str(path))
    return written


def _write_atomically(output: np.ndarray, path: Path) -> None:
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.absolute().parent)
    os.close(fd)
    temporary = Path(name)
    try:
        _write(output, temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _write(output: np.ndarray, path: Path) -> None:
    from diffusers.utils import numpy_to_pil

    if output.ndim == 3:
        numpy_to_pil(output[None])[0].save(path)
    elif path.suffix.lower() == ".gif":
        from diffusers.utils import export_to_gif

        export_to_gif(numpy_to_pil(output), str(path), fps=8)
    else:
        from diffusers.utils import export_to_video

        export_to_video(list(output), str(path), fps=8)
