"""The server's counters, in Prometheus' text format (``GET /metrics``): no client library needed.

``paradiff_requests_total{outcome}`` counts every generation request (images, videos) that carried the API key
by how it was answered (``ok``, ``invalid`` for a 4xx,
``rejected`` for a full queue, ``timeout``, ``failed`` for a 5xx, ``cancelled`` for a client gone before its
request started); ``paradiff_request_seconds`` is the latency of the ones answered ``ok`` (arrival to reply),
``paradiff_step_seconds`` the seconds per denoising step of each call; the gauges say what waits and runs now.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

OUTCOMES = ("ok", "invalid", "rejected", "timeout", "failed", "cancelled")
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{name}_bucket{{le="{le}"}} {running}')
        return [*lines, f"{name}_sum {self.total:.6f}", f"{name}_count {self.count}"]


@dataclass
class Metrics:
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    step: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    restarts: int = 0

    def answered(self, outcome: str, seconds: float | None = None) -> None:
        self.requests[outcome] += 1
        if outcome == "ok" and seconds is not None:
            self.latency.observe(seconds)

    def text(self, queued: int, running: int, ready: bool) -> str:
        lines = [
            "# HELP paradiff_requests_total Requests answered, by outcome.",
            "# TYPE paradiff_requests_total counter",
            *(f'paradiff_requests_total{{outcome="{name}"}} {count}' for name, count in self.requests.items()),
            "# HELP paradiff_request_seconds Seconds from arrival to reply of the requests answered ok.",
            "# TYPE paradiff_request_seconds histogram",
            *self.latency.lines("paradiff_request_seconds"),
            "# HELP paradiff_step_seconds Seconds per denoising step of each call the ranks ran.",
            "# TYPE paradiff_step_seconds histogram",
            *self.step.lines("paradiff_step_seconds"),
            "# HELP paradiff_queue_depth Requests waiting for the ranks.",
            "# TYPE paradiff_queue_depth gauge",
            f"paradiff_queue_depth {queued}",
            "# HELP paradiff_requests_running Requests the ranks are drawing now.",
            "# TYPE paradiff_requests_running gauge",
            f"paradiff_requests_running {running}",
            "# HELP paradiff_ready Whether the ranks are loaded and serving (1) or not (0).",
            "# TYPE paradiff_ready gauge",
            f"paradiff_ready {int(ready)}",
            "# HELP paradiff_restarts_total Times the rank group was restarted after losing a rank.",
            "# TYPE paradiff_restarts_total counter",
            f"paradiff_restarts_total {self.restarts}",
        ]
        return "\n".join(lines) + "\n"
