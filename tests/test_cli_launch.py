"""paradiff's launcher: loopback only, a ParadiffError or a failure from any rank in one line, no process left
behind after a failure, a killed worker or Ctrl-C."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from paradiff import ParadiffError
from paradiff.launch import SILENT_S, RanksFailed, _Worker, cpu_seconds, run_on_ranks

#: Long enough that the run is still drawing when the test acts (about 20 s of steps on one idle core).
LONG_RUN = ["generate", "a red circle", "--steps", "400", "--no-baseline"]
#: How long the CLI may take to notice, stop every worker and exit (generous: the 2 cores are shared).
REACT_BOUND_S = 20


# --- tasks for the workers (module level, so the workers import them by name) ---------------------------


def _rank_and_sum() -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return dist.get_rank(), float(total)


def _fail_on_rank_1(kind: str) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if kind == "paradiff":
            raise ParadiffError("rank 1 refuses this input")
        raise RuntimeError("rank 1 broke\nwith a second line")
    dist.barrier()  # rank 0 waits here until it is stopped
    return "unreachable"


# --- the launcher itself -----------------------------------------------------------------------------------


def _on_two_ranks(fn, *args):
    """``run_on_ranks(fn, 2, *args)``, verbose: its workers then skip quieting diffusers and transformers, which
    imports them (seconds a worker) for tasks that use neither; nothing checked here depends on it."""
    return run_on_ranks(fn, 2, *args, verbose=True)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The launcher's store folder and log go to ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.timeout(120)
def test_rank_0_result_and_a_paradiff_error_from_one_rank(private_tmp):
    assert _on_two_ranks(_rank_and_sum) == (0, 3.0)
    assert list(private_tmp.iterdir()) == [], "store folder and log are removed after a good run"
    with pytest.raises(ParadiffError, match="^rank 1 refuses this input$"):
        _on_two_ranks(_fail_on_rank_1, "paradiff")
    assert list(private_tmp.iterdir()) == []


@pytest.mark.timeout(120)
def test_any_other_error_stops_every_rank_in_one_line_with_a_log(private_tmp):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failure:
        _on_two_ranks(_fail_on_rank_1, "error")
    assert str(failure.value) == "rank 1 failed: RuntimeError: rank 1 broke with a second line"
    assert time.monotonic() - start < 60, "rank 0, blocked in a barrier, was stopped at once"
    log = failure.value.log
    assert log.parent == private_tmp and "Traceback" in log.read_text() and "in _fail_on_rank_1" in log.read_text()
    assert [path.name for path in private_tmp.iterdir()] == [log.name], "the store folder is removed"


def test_under_torchrun_the_function_runs_in_this_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_on_ranks(os.getpid, 2) == os.getpid()


# --- the CLI's processes -----------------------------------------------------------------------------------


def _ours(folder) -> list[str]:
    """What paradiff left in ``folder`` (its logs, store folders, the output); torch's own caches aside."""
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("paradiff") or path.name == "x.png")


def _start_cli(tmp_path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "paradiff.cli", *argv, "--out", str(tmp_path / "x.png")]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _listening(process: psutil.Process) -> list:
    connections = getattr(process, "net_connections", None) or process.connections
    try:
        return [c.laddr for c in connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.NoSuchProcess:
        return []


def _cmdline(process: psutil.Process) -> str:
    """A process's command line; empty for one that ended (or is a zombie) since the tree was listed."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _wait_for_ranks(cli: subprocess.Popen, timeout_s: float = 120) -> tuple[list[psutil.Process], list]:
    """The CLI's descendants and every socket they listen on, once both workers joined the process group.

    Short-lived helpers (torch's and the compilers' own subprocesses) come and go while the tree is read.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert cli.poll() is None, cli.communicate()
        tree = [psutil.Process(cli.pid), *psutil.Process(cli.pid).children(recursive=True)]
        workers = [process for process in tree if "paradiff.launch.worker" in _cmdline(process)]
        listening = [address for process in tree for address in _listening(process)]
        if len(workers) == 2 and all(_listening(worker) for worker in workers):  # gloo listens once joined
            return tree, listening
        time.sleep(0.2)
    raise AssertionError("the workers did not join within the time allowed")


def _assert_gone(processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 10
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    for process in processes:  # each worker led a process group of its own: none of it is left
        with pytest.raises(ProcessLookupError):
            os.killpg(process.pid, 0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("sent", "said"),
    [(signal.SIGKILL, "was killed by SIGKILL"), (signal.SIGSTOP, "showed no sign of life for 5 s (stopped or hung)")],
    ids=["killed", "frozen"],
)
def test_a_lost_worker_is_one_line_and_exit_1_and_every_socket_is_on_loopback(tmp_path, sent, said):
    """A killed worker is reported at once, a frozen one (SIGSTOP: alive, silent) once its beats stop: within
    seconds either way, never after a collective's timeout (the run's --timeout is the default 600 s)."""
    cli = _start_cli(tmp_path, *LONG_RUN)
    try:
        tree, listening = _wait_for_ranks(cli)
        assert listening, "gloo listens while the ranks run"
        assert all(ipaddress.ip_address(address.ip).is_loopback for address in listening), listening
        rank_1 = next(p for p in tree if "paradiff.launch.worker" in _cmdline(p) and p.environ().get("RANK") == "1")
        rank_1.send_signal(sent)
        lost = time.monotonic()
        out, err = cli.communicate(timeout=REACT_BOUND_S * 3)
    finally:
        cli.kill()
    assert time.monotonic() - lost < REACT_BOUND_S
    assert cli.returncode == 1, err[-3000:]
    assert err.count("paradiff:") == 1 and "Traceback" not in err, err[-3000:]
    message = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert f"paradiff: error: rank 1 (pid {rank_1.pid}) {said} (details in {tmp_path}" in message
    _assert_gone(tree[1:])


@pytest.fixture
def sigint_handled():
    """SIGINT handled in this process while the test runs, so that the CLI it starts gets the default action.

    A shell starts a background job (``pytest ... &``) with SIGINT ignored, the children inherit that, and
    Python then leaves Ctrl-C ignored too; a handled signal is reset to the default across ``exec``.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(240)
def test_ctrl_c_exits_130_and_leaves_no_process(tmp_path, sigint_handled):
    cli = _start_cli(tmp_path, *LONG_RUN)
    try:
        tree, _ = _wait_for_ranks(cli)
        cli.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        out, err = cli.communicate(timeout=REACT_BOUND_S * 3)
    finally:
        cli.kill()
    assert time.monotonic() - interrupted < REACT_BOUND_S
    assert cli.returncode == 130, err[-3000:]
    assert err.rstrip("\n").endswith("paradiff: interrupted") and err.count("paradiff:") == 1, err[-3000:]
    assert "Traceback" not in err and out == ""
    _assert_gone(tree[1:])
    assert _ours(tmp_path) == [], "no output, log or store folder is left"


@pytest.mark.parametrize(("stopped", "silent"), [(False, False), (True, True)], ids=["busy", "stopped"])
def test_a_worker_that_uses_cpu_time_is_alive_without_beats(stopped, silent):
    """A worker whose beats stopped 10 s ago counts as silent only if its CPU time stopped too: a long call that
    holds the interpreter lock on a loaded host keeps the heartbeat thread from running, but not the worker."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        if stopped:
            process.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        now = time.monotonic()
        worker = _Worker(0, process, -1, bytearray(), -1, last_beat=now - 10, last_progress=now - 10)
        worker.cpu_s = cpu_seconds(process.pid)
        time.sleep(0.5)
        assert (worker.silent_s(time.monotonic()) > SILENT_S) is silent
    finally:
        process.kill()
        process.wait()
