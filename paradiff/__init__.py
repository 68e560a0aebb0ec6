"""paradiff: run an unmodified diffusers pipeline faster on several devices.

pipe = paradiff.parallelize(pipe, strategy="patch", warmup_steps=4)
images = pipe(...).images
"""

from .config import ParallelConfig
from .errors import ParadiffError
from .pipeline import comm_stats, parallelize, unparallelize

__all__ = ["ParallelConfig", "ParadiffError", "comm_stats", "parallelize", "unparallelize"]
__version__ = "0.1.0"
