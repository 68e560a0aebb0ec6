"""Small but real diffusers pipelines with random weights, built offline from configs: one table of them all.

``build(name, seed)`` returns ``(pipe, call_kwargs)`` for any name of :data:`TABLE`: a genuine diffusers pipeline whose
models are instantiated from hand-written configs under ``torch.manual_seed(seed)`` (every process that builds a name
with the same seed holds bit-identical weights, and the caller's global RNG is left as it was), and the arguments of a
call that runs it on CPU in about a second. ``names(kind=...)`` lists them: the classic families at two sizes (``sd``,
``sdxl``, ``pixart``, ``sd3``, ``flux`` and ``<family>-bench``), one pipeline per further image DiT and video family,
a CogVideoX with its text encoder (``cogvideox-text``) and a diffusion-forcing SkyReels-V2 (``skyreels-df``).

The classic families keep their own interface: ``build_pipeline(family, size, seed, scheduler)`` and
``prompt_inputs(pipe, family)`` (see :mod:`paradiff.tiny.classic`).

Importing this package imports diffusers: modules that a command line's parent process imports reach it only inside
the functions that build a pipeline.
"""

from .classic import FAMILIES, SCHEDULERS, SIZES, prompt_inputs
from .parts import count_parameters
from .table import KINDS, TABLE, Tiny, build, build_pipeline, names, pipeline, save

__all__ = [
    "FAMILIES",
    "KINDS",
    "SCHEDULERS",
    "SIZES",
    "TABLE",
    "Tiny",
    "build",
    "build_pipeline",
    "count_parameters",
    "names",
    "pipeline",
    "prompt_inputs",
    "save",
]
