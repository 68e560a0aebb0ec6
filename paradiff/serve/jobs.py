"""What travels between the HTTP front and the ranks: checked requests, batches of them, and what came of each.

Plain picklable records (no torch): the front and rank 0 may be different processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One client's request, checked against the model's card (:mod:`.requests`): every field is settled."""

    id: str
    #: ``image`` or ``video``.
    kind: str
    prompt: str
    negative_prompt: str | None
    #: Pictures to draw, from seeds ``seed``, ``seed + 1``, ...
    n: int
    height: int
    width: int
    steps: int
    #: The classifier-free guidance scale; None: the pipeline's own.
    guidance: float | None
    seed: int
    #: Frames of a video (None: the model's own, or an image).
    frames: int | None
    #: ``auto`` or a strategy name.
    strategy: str
    warmup: int
    #: ``exact`` or ``displaced``: what ``auto`` may pick.
    fidelity: str
    #: How the pictures are encoded: ``png``, ``jpeg`` or ``webp`` for images, ``mp4`` for videos.
    output_format: str
    #: Whether the guidance runs (scale above 1): the CFG split needs it, and it changes a plan.
    guided: bool = True
    #: The PSNR floor (dB against one device) the staleness guard holds (``fidelity_floor_db``); None: no guard.
    floor: float | None = None

    @property
    def shape(self) -> tuple:
        """What a plan depends on: requests of one shape run best under one setting (and may share a call)."""
        return (self.kind, self.height, self.width, self.frames, self.steps, self.n, self.guided)

    def batch_key(self) -> tuple:
        """Requests with equal keys can be drawn in one call: one shape, setting and guidance."""
        return (
            *self.shape,
            self.guidance,
            self.strategy,
            self.warmup,
            self.fidelity,
            self.floor,
            self.negative_prompt is None,
        )


@dataclass(frozen=True)
class Drawn:
    """What one request got: its encoded pictures and how they were made (the reply's ``paradiff`` object)."""

    pictures: list[bytes]
    strategy: str
    seconds: float
    bytes_per_step: float
    why: str
    #: Seconds the call spent planning (``auto``, first request of its shape).
    planning_s: float = 0.0
    #: Requests drawn in the same call (batching), this one included.
    batch: int = 1
    #: Under a fidelity floor: the steps the staleness guard refreshed, its threshold (None where it refreshes
    #: every step) and the seconds that calibrated it (the first request of a shape); None without a floor.
    guard: dict | None = None

    def report(self) -> dict:
        report = {
            "strategy": self.strategy,
            "seconds": round(self.seconds, 4),
            "bytes_per_step": round(self.bytes_per_step),
            "why": self.why,
            "planning_seconds": round(self.planning_s, 4),
            "batch": self.batch,
        }
        return report if self.guard is None else {**report, "guard": self.guard}


@dataclass(frozen=True)
class Refused:
    """A request the ranks could not draw: the HTTP status and the message to answer it with."""

    status: int
    message: str


@dataclass(frozen=True)
class Batch:
    """Requests drawn in one call (one request unless batching is on)."""

    requests: tuple[Request, ...]
    ids: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "ids", tuple(request.id for request in self.requests))
