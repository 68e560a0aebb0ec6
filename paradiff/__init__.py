"""paradiff: run an unmodified diffusers pipeline faster on several devices.

    pipe = paradiff.parallelize(pipe, strategy="patch", warmup_steps=4)
    images = pipe(...).images

The functions that need diffusers are imported on first use, so ``import paradiff`` and the CLI's
argument checks stay fast.
"""

from .config import ParallelConfig
from .errors import ParadiffError, ParadiffWarning, PeerFailure

__all__ = [
    "ParallelConfig",
    "ParadiffError",
    "ParadiffWarning",
    "PeerFailure",
    "check_parallelize",
    "comm_stats",
    "load_stage_pipeline",
    "parallelize",
    "plan_of",
    "unparallelize",
]
__version__ = "0.1.0"

_PIPELINE_API = ("comm_stats", "parallelize", "plan_of", "unparallelize")


def __getattr__(name: str):
    if name == "check_parallelize":
        from .checks import check_parallelize

        return check_parallelize
    if name in _PIPELINE_API:
        from . import pipeline

        return getattr(pipeline, name)
    if name == "load_stage_pipeline":
        from .stages.load_stage import load_stage_pipeline

        return load_stage_pipeline
    raise AttributeError(f"module 'paradiff' has no attribute {name!r}")
