"""A script under ``benchmarks/`` imported as a module, so that a test calls its functions in-process."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` as a module named ``name`` (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
