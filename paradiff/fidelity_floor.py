"""``fidelity_floor_db``: the staleness guard's threshold, calibrated so that the call it runs on holds a PSNR floor.

The guard (``runtime.staleness``) refreshes a displaced step when the prediction moved more than a threshold
between the last two steps. Which threshold keeps the image within the floor depends on the model, the size and
the steps, so the first call of a shape calibrates it on the call itself, on the ranks:

1. a reference run that refreshes every step: equal to one device, and it gives every step's movement;
2. the candidate thresholds between those movements, each refreshing the k steps that moved most (k = 0 … all);
3. a bisection for the fewest refreshes whose image is within ``floor + MARGIN_DB`` of the reference (the margin
   is for seeds and prompts whose displaced steps cost a little more than the calibration's; a prompt that costs
   much more can fall under the floor). Refreshing all is exact and never needs a run.

The threshold is cached per model (its description: layers, adapters, weights' checksum, scheduler), call shape,
steps, strategy and ranks, in ``$PARADIFF_CACHE_DIR`` (default ``~/.cache/paradiff``), so a process that asks
again calibrates nothing. It is kept with the layout the strategy chose at run time where that layout changes
the pictures (``asyncdiff``'s measured cut): a threshold holds the floor on its own layout only, so a process that
finds it runs that layout, or calibrates again where it cannot. The calibration runs leave the caller's generators
as they were and call no callbacks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ParadiffError
from .metrics import psnr

#: The calibration aims this many dB above the floor, for the prompts and seeds it did not run.
MARGIN_DB = 1.0
#: The folder the calibrated thresholds are kept in (default ``~/.cache/paradiff``).
CACHE_VARIABLE = "PARADIFF_CACHE_DIR"
CACHE_FILE = "fidelity_floor.json"


@dataclass(frozen=True)
class Calibration:
    """The threshold a calibration chose, and what it measured on the way."""

    threshold_db: float
    #: PSNR of the chosen threshold's run against the reference (inf: it refreshes every step, exact).
    psnr_db: float
    refreshed_steps: tuple[int, ...]
    #: Runs of the call it took, the reference included.
    runs: int


def check_floor(floor) -> None:
    if floor is None:
        return
    if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not 0 < floor < math.inf:
        raise ParadiffError(f"fidelity_floor_db must be None or a positive number of dB (e.g. 30), got {floor!r}")


def thresholds_between(moved_db: dict[int, float]) -> list[float]:
    """Thresholds that refresh the 0, 1, … k steps that moved most (smallest figures first) in a reference run."""
    values = sorted(value for value in moved_db.values() if math.isfinite(value))
    if not values:
        return [math.inf]
    between = [(low + high) / 2 for low, high in zip(values, values[1:], strict=False) if low < high]
    return [values[0] - 1.0, *between, values[-1] + 1.0]


def calibrate(
    run: Callable[[float | None], tuple[np.ndarray, dict]],
    floor_db: float,
    agreed: Callable[[float], float] = lambda psnr_db: psnr_db,
) -> Calibration:
    """The threshold with the fewest refreshes whose image holds ``floor_db`` + :data:`MARGIN_DB` against the
    reference. ``run(threshold)`` runs the call under the guard (``None``: refresh every step) and returns its
    images in [0, 1] and the guard's counters (``GuardCounters`` as a dict). ``agreed(psnr)`` is the PSNR every
    rank bisects on (rank 0's): each run is a collective, so the ranks must take the same branch."""
    reference, counters = run(None)
    candidates = thresholds_between(counters["moved_db"])
    target = floor_db + MARGIN_DB
    low, high = 0, len(candidates) - 1
    measured = {high: (math.inf, tuple(counters["refreshed_steps"]))}
    runs = 1
    while low < high:
        middle = (low + high) // 2
        images, counters = run(candidates[middle])
        runs += 1
        measured[middle] = (agreed(psnr(images, reference)), tuple(counters["refreshed_steps"]))
        if measured[middle][0] >= target:
            high = middle
        else:
            low = middle + 1
    psnr_db, refreshed = measured[high]
    return Calibration(candidates[high], psnr_db, refreshed, runs)


def cache_key(model_description: dict, call_shape: tuple, steps: int, strategy: dict, ranks: int, floor: float):
    """One calibration's key: what decides how far the predictions move and what a refresh buys."""
    described = json.dumps([model_description, call_shape, steps, strategy, ranks, floor], sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:24]


def _cache_file() -> Path:
    folder = os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "paradiff"
    return Path(folder) / CACHE_FILE


@dataclass(frozen=True)
class Kept:
    """A calibration kept by an earlier process: its threshold, and the strategy's run-time layout it ran on."""

    threshold_db: float
    layout: dict


def kept_calibration(key: str) -> Kept | None:
    """The calibration kept under ``key``, if any (a cache that cannot be read, or a record without its layout,
    counts as none)."""
    try:
        kept = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return None
    value = kept.get(key) if isinstance(kept, dict) else None
    if not isinstance(value, dict) or "threshold_db" not in value or not isinstance(value.get("layout"), dict):
        return None
    return Kept(float(value["threshold_db"]), value["layout"])


def remember(key: str, calibration: Calibration, layout: dict) -> None:
    """Keep ``calibration`` and the ``layout`` it ran on under ``key`` (written whole, then renamed: a reader never
    sees half a file)."""
    path = _cache_file()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    kept[key] = {
        "threshold_db": calibration.threshold_db,
        "psnr_db": calibration.psnr_db,
        "refreshed_steps": list(calibration.refreshed_steps),
        "layout": layout,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(kept, indent=1, sort_keys=True, default=str))
    partial.replace(path)
