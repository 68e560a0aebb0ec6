"""What every rank of ``paradiff serve`` runs: load the pipeline once, then draw each batch rank 0 hands out.

Rank 0 takes batches from the front (:mod:`.link`), decides each one's setting (:class:`.layout.Layout`) and
broadcasts both on a gloo group of their own, whose waits are long: the other ranks wait there while the
server is idle. Every rank lays the pipeline out and draws; rank 0 encodes the pictures and sends back, per
request, what it got (:class:`.jobs.Drawn`) or why not (:class:`.jobs.Refused`).

A refusal the ranks reach alike (a :class:`~paradiff.errors.ParadiffError` from a check) answers the batch
400 and the ranks go on. A lost rank (:class:`~paradiff.errors.PeerFailure`) or any other error answers it
503 or 500 and ends this rank, with an error: the group is broken, and the front restarts it.
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import timedelta

from .card import describe
from .jobs import Batch, Drawn, Refused
from .layout import Layout, Setting
from .link import Closed, SocketLink
from .settings import ServeSettings

#: Seconds rank 0 waits for a batch before it wakes the other ranks with an idle message, so that no wait on
#: the batch group nears its timeout (:data:`BATCH_WAIT`) however long the server stays idle.
IDLE_S = 600.0
BATCH_WAIT = timedelta(hours=1)


def serve_on_rank(settings: ServeSettings, address: str) -> None:
    """One rank started by paradiff's launcher: rank 0 connects to the front at the Unix socket ``address``."""
    import torch.distributed as dist

    link = SocketLink.connect(address) if dist.get_rank() == 0 else None
    try:
        run_ranks(settings, link)
    finally:
        if link is not None:
            link.close()


def _share(message, group):
    """Rank 0's ``message`` on every rank."""
    import torch.distributed as dist

    if group is None:
        return message
    shared = [message]
    dist.broadcast_object_list(shared, src=0, group=group)
    return shared[0]


def run_ranks(settings: ServeSettings, link) -> None:
    """Load, tell the front what the model can do (rank 0), then draw batches until the front says stop."""
    import torch
    import torch.distributed as dist

    from ..config import check_world
    from ..devices import rank_device, torch_dtype
    from ..errors import PeerFailure
    from ..loading import load_pipeline
    from ..runtime.distributed import ensure_process_group

    torch.set_num_threads(settings.threads)
    check_world(settings.strategy, settings.nproc)  # before loading: settings that cannot run end the server
    ensure_process_group(timedelta(seconds=settings.timeout_s))
    rank, nproc = dist.get_rank(), dist.get_world_size()
    device = rank_device(settings.device)
    pipe = load_pipeline(settings.model, dtype=torch_dtype(settings.dtype, device), allow_pickle=settings.allow_pickle)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    group = dist.new_group(backend="gloo", timeout=BATCH_WAIT) if nproc > 1 else None
    layout = Layout(pipe, nproc, settings.timeout_s, settings.strategy)
    if rank == 0:
        link.send(("ready", describe(pipe, settings.model, nproc, settings.warmup, settings.limits.size)))
    while True:
        message = _next(link, layout) if rank == 0 else None
        message = _share(message, group)
        if message[0] == "stop":
            return
        if message[0] == "batch":
            _, batch, setting = message
            try:
                outcome = _draw(pipe, settings, layout, batch, setting, rank)
            except PeerFailure as error:
                _last_answer(link, batch, Refused(503, f"a rank of the server was lost: {error}"))
                raise
            except Exception as error:
                _last_answer(link, batch, Refused(500, f"the ranks failed: {type(error).__name__}: {error}"))
                raise
            if rank == 0:
                _answer(link, batch, outcome)


def _last_answer(link, batch: Batch, refused: Refused) -> None:
    """Rank 0 answers the batch before its error ends it (the other ranks have no link)."""
    if link is not None:
        _answer(link, batch, Refused(refused.status, " ".join(refused.message.split())))


def _next(link, layout: Layout) -> tuple:
    """Rank 0: the next message for every rank: a batch with its setting, ``idle`` or ``stop``."""
    try:
        message = link.receive(IDLE_S)
    except Closed:
        return ("stop",)
    if message is None:
        return ("idle",)
    if message[0] != "batch":
        return ("stop",)
    _, batch, asked = message
    return ("batch", batch, layout.setting_for(batch.requests[0], asked))


def _answer(link, batch: Batch, outcome) -> None:
    with contextlib.suppress(Closed):  # the front has gone; the next receive stops the ranks
        link.send(("done", batch.ids, outcome))


def _draw(pipe, settings: ServeSettings, layout: Layout, batch: Batch, setting: Setting, rank: int):
    """Every rank: ``batch`` under ``setting``. Rank 0's outcome: one :class:`Drawn` per request, or a
    :class:`Refused` for them all; a lost rank or another error is raised."""
    import paradiff

    from ..errors import ParadiffError, PeerFailure

    try:
        start = time.perf_counter()
        layout.apply(setting)
        result = pipe(**call_inputs(pipe, settings.model, batch))
    except PeerFailure:
        raise
    except ParadiffError as error:  # a check every rank reaches alike: the ranks go on
        return Refused(400, str(error))
    seconds = time.perf_counter() - start
    planning_s = 0.0
    if setting.plans:
        planning_s = paradiff.plan_of(pipe).planning_s
        setting = layout.learn(batch.requests[0], setting)
    if rank != 0:
        return None
    stats = paradiff.comm_stats(pipe) if layout.current else {}
    return _drawn(result, batch, setting, seconds, planning_s, stats.get("bytes_per_step", 0.0), _guard(stats))


def _guard(stats: dict) -> dict | None:
    """What the staleness guard did in the call, for the reply: plain JSON (no infinite threshold)."""
    guard = stats.get("guard")
    if guard is None:
        return None
    threshold = guard["threshold_db"]
    return {
        "refreshed_steps": list(guard["refreshed_steps"]),
        "threshold_db": threshold if threshold is not None and math.isfinite(threshold) else None,
        "calibration_seconds": round(guard["calibration_s"], 4),
    }


def _drawn(
    result, batch: Batch, setting: Setting, seconds: float, planning_s: float, moved: float, guard: dict | None
) -> list[Drawn]:
    import numpy as np

    from .media import encode

    frames = getattr(result, "frames", None)
    pictures = np.asarray(result.images if frames is None else frames)
    per_request = len(pictures) // len(batch.requests)
    drawn = []
    for index, request in enumerate(batch.requests):
        mine = pictures[index * per_request : (index + 1) * per_request]
        drawn.append(
            Drawn(
                encode(mine, request.output_format),
                setting.label,
                seconds,
                moved,
                setting.why,
                planning_s,
                len(batch.requests),
                guard,
            )
        )
    return drawn


def call_inputs(pipe, model: str, batch: Batch) -> dict:
    """The keyword arguments of the pipeline call that draws every request of ``batch`` (one shape)."""
    import torch

    from ..loading import PER_PROMPT_ARGUMENTS, call_parameters, frames_parameter, prompt_kwargs

    first = batch.requests[0]
    inputs = prompt_kwargs(pipe, model, first.prompt, guidance=first.guidance, negative_prompt=first.negative_prompt)
    if len(batch.requests) > 1:
        inputs["prompt"] = [request.prompt for request in batch.requests]
        if first.negative_prompt is not None:
            inputs["negative_prompt"] = [request.negative_prompt for request in batch.requests]
    inputs.update(height=first.height, width=first.width, num_inference_steps=first.steps, output_type="np")
    frames = frames_parameter(pipe)
    if frames is not None and first.frames is not None:
        inputs[frames] = first.frames
    parameters = call_parameters(pipe)
    if first.n > 1:
        inputs[next(name for name in PER_PROMPT_ARGUMENTS if name in parameters)] = first.n
    seeds = [request.seed + i for request in batch.requests for i in range(request.n)]
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    inputs["generator"] = generators[0] if len(generators) == 1 else generators
    return inputs
