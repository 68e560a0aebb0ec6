"""A job of N ranks whose last rank is killed (SIGKILL) or frozen (SIGSTOP) at step 2 of 6 steps of transfers.

Each step all-gathers a piece from every rank and swaps rows with the neighbours, as a parallelized
denoiser does (through paradiff's own communicator, its heartbeats and its failure reports; torch alone,
so that N processes start in seconds). Each surviving rank prints one JSON line: the PeerFailure it raised
(or none) and the seconds the job took. Run under torchrun (``python -m torch.distributed.run
--nproc-per-node 4 peer_failure_job.py kill``) or through :func:`run_rank` on processes the test spawns.
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

from paradiff.errors import PeerFailure
from paradiff.runtime.comm import Communicator
from paradiff.runtime.distributed import RankGroup
from paradiff.runtime.liveness import start_heartbeat
from paradiff.runtime.step_state import StepState

#: Every wait of the job is bounded by this many seconds.
TIMEOUT_S = 4.0
#: The late-rank job's ``timeout_s``: its rank 1 never comes, so rank 0's wait ends at the timeout however long it is.
LATE_TIMEOUT_S = 1.0
#: The step at which the last rank is killed or frozen, and the steps of the job.
FAILING_STEP, STEPS = 2, 6
#: The longest a survivor waits for the others' reports before it exits (under torchrun, the first to exit
#: makes the agent stop the rest).
REPORTS_S = 30.0


def transfers(comm: Communicator, mode: str) -> None:
    """The job's steps; the last rank kills or stops itself at :data:`FAILING_STEP`."""
    me, world = comm.rank, comm.size
    piece = torch.full((4096,), float(me))
    for step in range(STEPS):
        comm.state.enter_call(None, float(STEPS - step))
        if me == world - 1 and step == FAILING_STEP:
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        gathered = [torch.empty_like(piece) for _ in range(world)]
        transfer, _ = comm.all_gather(gathered, piece)
        comm.wait([transfer])
        rows = [torch.empty(64) for _ in range(2)]
        works, _ = comm.swap_with_neighbours((piece[:64], piece[-64:]), tuple(rows), comm.tags(2))
        comm.wait(works)


def job(mode: str) -> dict:
    torch.set_num_threads(1)
    comm = Communicator(RankGroup.world(timedelta(seconds=TIMEOUT_S)), StepState(warmup_steps=STEPS))
    start_heartbeat()
    start = time.monotonic()
    try:
        transfers(comm, mode)
        error = None
    except PeerFailure as failure:
        error = str(failure)
    return {"rank": dist.get_rank(), "error": error, "seconds": time.monotonic() - start}


def run_rank(rank: int, world_size: int, mode: str, store_path: str, results) -> None:
    """One rank of a job started without torchrun: a gloo group over a file store, on loopback."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    results.put(job(mode))


def wait_for_reports() -> None:
    """Count this survivor's report in the store and wait (bounded) for every survivor's."""
    store = dist.distributed_c10d._get_default_store()
    store.add("job/reported", 1)
    deadline = time.monotonic() + REPORTS_S
    while store.add("job/reported", 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    report = job(sys.argv[1])
    os.write(sys.stdout.fileno(), f"{json.dumps(report)}\n".encode())  # one write: the ranks share the pipe
    wait_for_reports()
    sys.exit(1 if report["error"] else 0)  # as an uncaught PeerFailure would: torchrun then ends the job


def late_rank(rank: int, store_path: str, done, results) -> None:
    """A 2-rank job in which rank 1 never calls parallelize(): rank 0's PeerFailure (or None) goes to ``results``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        done.wait(120)  # elsewhere in its program until rank 0 has reported
        return
    import paradiff
    from paradiff.tiny import build_pipeline

    torch.set_num_threads(1)
    pipe = build_pipeline("sd")
    start = time.monotonic()
    try:
        paradiff.parallelize(pipe, strategy="patch", timeout_s=LATE_TIMEOUT_S)
        error = None
    except PeerFailure as failure:
        error = str(failure)
    results.put({"error": error, "seconds": time.monotonic() - start})
