"""A rank killed or frozen mid-call: every other rank raises a PeerFailure naming it (the one lost first, not a rank
that left because of it), soon, and nothing is left running; a rank that never reaches parallelize() is named too."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from peer_failure_job import FAILING_STEP, LATE_TIMEOUT_S, TIMEOUT_S, late_rank, run_rank

import paradiff
from paradiff.runtime.liveness import WATCH_S

JOB = Path(__file__).with_name("peer_failure_job.py")
#: Ranks of the job: enough that a survivor's neighbour leaves (after reporting) before a third rank looks.
WORLD = 4
LOST = WORLD - 1
#: Seconds a survivor may take beyond the timeout (a frozen peer) to watch the heartbeats and report.
REPORT_S = WATCH_S + 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def _sigterm_pending(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & 1 << (signal.SIGTERM - 1) for mask in masks)


def _wake_stopped(pid: int, within_s: float = 60) -> None:
    """SIGCONT to the stopped processes under ``pid`` once torchrun's SIGTERM waits on them, so they end at it
    (woken earlier, a rank would go on and report too)."""
    deadline = time.monotonic() + within_s
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError):
            if child.status() == psutil.STATUS_STOPPED:
                while not _sigterm_pending(child.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                child.send_signal(signal.SIGCONT)


def _check_failure(report: dict, mode: str) -> None:
    error = report["error"]
    assert error is not None, f"rank {report['rank']} raised no PeerFailure"
    assert error.startswith(f"rank {LOST} "), error
    assert ("died (its process is gone)" if mode == "kill" else "stopped responding") in error, error
    assert f"at step {FAILING_STEP}" in error and f"timeout_s={TIMEOUT_S:g}" in error, error
    limit = REPORT_S + (TIMEOUT_S if mode == "stop" else 0)
    assert report["seconds"] < limit, f"reported after {report['seconds']:.1f} s"


def _path() -> str:
    """This folder and the checkout, first on the path: the job's processes import this paradiff, installed or not."""
    return os.pathsep.join([str(JOB.parent), str(JOB.parents[1])])


@pytest.fixture(scope="module")
def forked():
    """The ranks of the jobs started without torchrun, forked from one server that imported torch and the job once:
    spawned, each rank imports them itself (seconds a rank, 4 ranks on 2 cores). The server finds the job through
    PYTHONPATH (Python 3.11's ignores the path it is given). Where the rank pools' fork server already runs (see
    conftest.py), the ranks fork from it and import the job there. The server is left running: stopping it waits
    for every process it forked, the pools' workers included; it ends with this process."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["peer_failure_job"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", _path())
        multiprocessing.forkserver.ensure_running()
    return context


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_every_survivor_names_the_lost_rank_without_torchrun(tmp_path, mode, forked):
    results = forked.Queue()
    store = str(tmp_path / "store")
    ranks = [forked.Process(target=run_rank, args=(rank, WORLD, mode, store, results)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    try:
        reports = sorted((results.get(timeout=90) for _ in range(WORLD - 1)), key=lambda report: report["rank"])
        assert [report["rank"] for report in reports] == list(range(LOST))
        for report in reports:
            _check_failure(report, mode)
        for process in ranks[:LOST]:
            process.join(30)
            assert process.exitcode == 0, "a survivor's process ends once it has raised"
    finally:
        for process in ranks:
            process.kill()
            process.join(10)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_every_survivor_names_the_lost_rank_under_torchrun(mode):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--max-restarts", "0"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.1"]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": _path(),
    }
    start = time.monotonic()
    launched = subprocess.Popen(
        [*command, str(JOB), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        first = ""
        if mode == "stop":  # every survivor's line (read whole: communicate() skips what readline() buffered); then,
            first = "".join(launched.stdout.readline() for _ in range(LOST))  # as torchrun's SIGTERM cannot end a
            _wake_stopped(launched.pid)  # stopped rank, it is woken, or torchrun would wait out its 30 s grace
        out, err = launched.communicate(timeout=150)
        out = first + out
    finally:
        os.killpg(launched.pid, signal.SIGKILL) if launched.poll() is None else None
    seconds = time.monotonic() - start
    assert launched.returncode != 0, "torchrun reports the failed job"
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if mode == "stop":  # the agent cannot see a frozen rank: every survivor names it, then exits
        assert sorted(report["rank"] for report in reports) == list(range(LOST)), out + err[-2000:]
    else:  # the agent sees the death at once and ends the job; a survivor names it if it gets there first
        assert "exitcode  : -9" in err or reports, err[-2000:]
        assert seconds < 60
    for report in reports:
        _check_failure(report, mode)
    leftover = subprocess.run(["pgrep", "-f", str(JOB)], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in leftover if _alive(int(pid))], "no rank is left running"


@pytest.mark.timeout(120)
def test_a_rank_that_never_reaches_parallelize_is_named(tmp_path, forked):
    """Not torch's "wait timeout" from inside its group creation, which names no rank."""
    results, done = forked.Queue(), forked.Event()
    ranks = [forked.Process(target=late_rank, args=(rank, str(tmp_path / "store"), done, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        report = results.get(timeout=90)
    finally:
        done.set()
        for process in ranks:
            process.join(10)
            process.kill()
    assert report["error"] is not None, "rank 0 went on without rank 1"
    assert report["error"].startswith(f"rank 1 did not reach parallelize() within timeout_s={LATE_TIMEOUT_S:g}"), report
    assert "rank 1 has shown no sign of life to paradiff" in report["error"], report
    assert report["seconds"] < LATE_TIMEOUT_S + REPORT_S, report


def test_a_late_rank_is_told_apart_by_its_heartbeat(monkeypatch):
    from datetime import timedelta

    from paradiff.runtime import failures, liveness

    monkeypatch.setattr(failures, "arrive", lambda timeout_s: [1, 2, 3])
    found = {1: "alive", 2: liveness.DEAD, 3: "unseen"}
    monkeypatch.setattr(failures, "whereabouts", lambda ranks: found)
    with pytest.raises(paradiff.PeerFailure) as raised:
        failures.meet_every_rank("parallelize()", timedelta(seconds=5))
    message = str(raised.value)
    assert message.startswith("ranks 1, 2, 3 did not reach parallelize() within timeout_s=5"), message
    assert "rank 1 is running but elsewhere in its program; rank 2 died (its process is gone); rank 3 has" in message
    monkeypatch.setattr(failures, "arrive", lambda timeout_s: [])
    failures.meet_every_rank("parallelize()", timedelta(seconds=5))  # every rank came: nothing raised


@pytest.mark.parametrize(
    ("loss", "transport_says", "expected"),
    [
        (
            (1,),
            "Connection closed by peer [127.0.0.1]:947",
            "rank 1 died (its connection closed) during the all-gather",
        ),
        ((2,), "Operation timed out!", "rank 2 stopped responding (no sign of life for"),
        (
            (3, "dead", 0),
            "Operation timed out!",
            "rank 3 died (its process is gone) during the all-gather at step 3 (rank 0",
        ),
        ((2, "frozen"), "Connection closed by peer", "rank 2 stopped responding (its process is there, but silent)"),
        ((), "Operation timed out!", "got no answer within timeout_s=4, though ranks 1, 2 are alive"),
        ((), "Connection closed by peer", "ranks 1, 2 closed the connection during the all-gather at step 3 while"),
        (None, "Application timeout caused pair closure", "(no answer within timeout_s=4), and the rendezvous store"),
    ],
)
def test_the_failure_names_who_from_the_heartbeats(monkeypatch, loss, transport_says, expected):
    """``loss``: (lost rank, how its process was found, the rank that saw it first), () all alive, None no store."""
    from datetime import timedelta

    from paradiff.runtime import failures, liveness

    if loss:
        how = {"dead": liveness.DEAD, "frozen": liveness.FROZEN}.get(loss[1] if len(loss) > 1 else "", liveness.SILENT)
        loss = liveness.Loss((loss[0],), (how,), loss[2] if len(loss) > 2 else -1)
    elif loss == ():
        loss = liveness.Loss()
    monkeypatch.setattr(failures, "lost_ranks", lambda ranks: loss)
    error = RuntimeError(transport_says)
    assert failures.is_transport_failure(error) and not failures.is_transport_failure(ValueError("bad height"))
    failure = failures.peer_failure(error, "the all-gather at step 3", [1, 2], timedelta(seconds=4))
    assert expected in str(failure), str(failure)
    assert isinstance(failure, RuntimeError) and isinstance(failure, paradiff.ParadiffError)


HEARTBEAT_AT_EXIT = """
import atexit, sys
import torch.distributed as dist
from paradiff.runtime import liveness

atexit.register(lambda: print("beating at exit:", liveness._current.thread.is_alive()))  # runs last
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
liveness.start_heartbeat()
print("beating:", liveness._current.thread.is_alive())
"""


@pytest.mark.timeout(60)
def test_the_heartbeat_stops_before_the_interpreter_exits(tmp_path):
    """A heartbeat still inside the store's C++ call while torch is torn down can abort the process."""
    command = [sys.executable, "-c", HEARTBEAT_AT_EXIT, str(tmp_path / "store")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["beating: True", "beating at exit: False"], done.stdout


GROUP_AT_EXIT = """
import atexit, os, sys
from datetime import timedelta
import torch.distributed as dist
from paradiff.runtime.distributed import ensure_process_group
from paradiff.runtime.liveness import start_heartbeat

atexit.register(lambda: print("group at exit:", dist.is_initialized()))  # runs last
if sys.argv[1] == "user":
    dist.init_process_group("gloo", init_method="env://")
ensure_process_group(timedelta(seconds=30))
start_heartbeat()
print("group:", dist.is_initialized())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("made_by", "at_exit"), [("paradiff", "False"), ("user", "True")])
def test_a_group_paradiff_made_is_destroyed_at_exit_and_a_users_group_is_left(made_by, at_exit):
    """torch.distributed asks whoever creates the default group to destroy it before exit (NCCL warns otherwise)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env = {**os.environ, **torchrun, "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [sys.executable, "-c", GROUP_AT_EXIT, made_by], capture_output=True, text=True, env=env, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["group: True", f"group at exit: {at_exit}"], done.stdout
