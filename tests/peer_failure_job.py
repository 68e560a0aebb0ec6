"""A 2-rank job whose rank 1 is killed (SIGKILL) or frozen (SIGSTOP) at step 2 of a 6-step call.

Each surviving rank prints one JSON line: the PeerFailure it raised (or none) and the seconds the call
took. Run under torchrun (``python -m torch.distributed.run --nproc-per-node 2 peer_failure_job.py kill``)
or through :func:`run_rank` on processes the test spawns itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import paradiff
from paradiff.errors import PeerFailure
from paradiff.tiny import build_pipeline, prompt_inputs

#: Every wait of the job is bounded by this many seconds.
TIMEOUT_S = 4.0
#: The step at which rank 1 is killed or frozen.
FAILING_STEP = 2


def signal_at_failing_step(mode: str):
    """A step-end callback that kills (``kill``) or freezes (``stop``) rank 1 at :data:`FAILING_STEP`."""
    signum = signal.SIGKILL if mode == "kill" else signal.SIGSTOP

    def on_step_end(pipe, step, timestep, tensors):
        if dist.get_rank() == 1 and step == FAILING_STEP:
            os.kill(os.getpid(), signum)
        return tensors

    return on_step_end


def job(mode: str) -> dict:
    torch.set_num_threads(1)
    pipe = paradiff.parallelize(build_pipeline("sd"), warmup_steps=1, timeout_s=TIMEOUT_S)
    start = time.monotonic()
    try:
        pipe(
            **prompt_inputs(pipe, "sd"),
            height=64,
            width=64,
            num_inference_steps=6,
            output_type="np",
            callback_on_step_end=signal_at_failing_step(mode),
        )
        error = None
    except PeerFailure as failure:
        error = str(failure)
    return {"rank": dist.get_rank(), "error": error, "seconds": time.monotonic() - start}


def run_rank(rank: int, mode: str, store_path: str, results) -> None:
    """One rank of a job started without torchrun: a gloo group over a file store, on loopback."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results.put(job(mode))


if __name__ == "__main__":
    report = job(sys.argv[1])
    print(json.dumps(report), flush=True)
    sys.exit(1 if report["error"] else 0)  # as an uncaught PeerFailure would: torchrun then ends the job
