"""What ``paradiff serve`` is started with: the model, the ranks, the defaults and the limits on requests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: The environment variable that holds the API key when ``--api-key`` is not given.
API_KEY_ENV = "PARADIFF_API_KEY"


@dataclass(frozen=True)
class Limits:
    """The largest request the server takes (a bigger one is answered 400 before any rank works)."""

    #: Pictures per request (``n``).
    n: int = 4
    #: Denoising steps per request.
    steps: int = 100
    #: Frames per video.
    frames: int = 128
    #: Characters of a prompt or a negative prompt.
    prompt_chars: int = 2000
    #: Pixels of a side (height or width).
    size: int = 2048


@dataclass(frozen=True)
class ServeSettings:
    model: str
    nproc: int
    #: ``auto`` (the fastest exact setting per request shape) or a strategy name: the default of every request.
    strategy: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    #: Requests waiting for the ranks beyond the one they run; one more is answered 429.
    max_queue: int = 16
    #: Seconds a request may take from its arrival to its reply (504 after).
    request_timeout_s: float = 600.0
    #: Restarts of the rank group in a row (without a request served between them) before the server gives up.
    max_restarts: int = 3
    #: Queued requests of the same shape drawn in one call (1: no batching).
    max_batch: int = 1
    #: Defaults of a request that does not say.
    steps: int = 20
    warmup: int = 4
    fidelity: str = "exact"
    #: The PSNR floor (dB against one device) of a request that sets none; None: fixed warm-ups only.
    fidelity_floor: float | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 1
    #: The longest one rank waits for another inside a call (``parallelize``'s ``timeout_s``).
    timeout_s: float = 600.0
    allow_pickle: bool = False
    verbose: bool = False
    limits: Limits = field(default_factory=Limits)

    @property
    def key(self) -> str | None:
        """The API key requests must carry: ``--api-key``, else the environment's, else none."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None
