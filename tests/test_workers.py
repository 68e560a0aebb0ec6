"""Tests for rank_workers.RankPool (multi-rank gloo test workers).

The task functions (underscore-prefixed, module level) run inside the worker processes, which
import this module by name: pytest's default import mode puts tests/ on ``sys.path`` and spawned
workers inherit it.

paradiff is imported inside the tests (fixture ``workers``), not at module level: workers import this
module to find the tasks, and this file restarts its workers several times on purpose, so keeping
``import paradiff`` (which imports diffusers, seconds per process) out of the workers keeps the
file fast. Ordinary test modules can import paradiff at the top.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest


@pytest.fixture(scope="module")
def workers():
    """The rank_workers module, imported in the test process only."""
    import rank_workers as workers

    return workers


# ---------------------------------------------------------------- tasks (run in the workers)


def _rank_info():
    import torch
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "master_addr": os.environ["MASTER_ADDR"],
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def _all_reduce_sum(scale, *, offset=0.0):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0, scale * (rank + 1.0)]) + offset
    dist.all_reduce(t)
    return t.tolist()


def _raise_on_rank1_while_rank0_waits():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1: spam-eggs-42")
    dist.barrier()  # never completes: rank 1 raised instead of joining
    return "unreachable"


def _hang_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)
    dist.barrier()
    return "unreachable"


def _die_on_rank1_raise_on_rank0():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    raise RuntimeError("rank 0 failed too: ham-99")


# ---------------------------------------------------------------- tests


def test_every_rank_reports_rank_and_world_size(pool2):
    infos = pool2.run(_rank_info)
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 for i in infos)
    assert all(i["backend"] == "gloo" for i in infos)
    for rank, info in enumerate(infos):
        assert info["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
        assert info["master_addr"] == "127.0.0.1"
        assert info["threads"] == 1
    assert sorted(i["pid"] for i in infos) == sorted(pool2.pids)


def test_all_reduce_sums_across_ranks(pool2):
    assert pool2.run(_all_reduce_sum, 10.0) == [[3.0, 30.0], [3.0, 30.0]]
    assert pool2.run(_all_reduce_sum, 1.0, offset=0.5) == [[4.0, 4.0], [4.0, 4.0]]


def test_rejects_lambdas_without_breaking_the_pool(pool2):
    pids = pool2.pids
    with pytest.raises(TypeError, match="module level"):
        pool2.run(lambda: 1)
    assert pool2.pids == pids


def test_task_module_loaded_by_path_is_found_in_workers(pool2, tmp_path):
    # Like pytest's "importlib" import mode: the module is not importable by name from sys.path.
    name = "paradiff_workers_test_pathmod"
    path = tmp_path / f"{name}.py"
    path.write_text("import torch.distributed as dist\n\ndef task(x):\n    return (dist.get_rank(), x * 2)\n")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        assert pool2.run(module.task, 21) == [(0, 42), (1, 42)]
    finally:
        sys.modules.pop(name, None)


def test_exception_on_one_rank_raises_rank_failure_then_pool_restarts(pool2, workers):
    before = [i["pid"] for i in pool2.run(_rank_info)]  # first: a pool left down by an earlier test restarts here
    starts = pool2.starts
    t0 = time.monotonic()
    with pytest.raises(workers.RankFailure) as info:
        pool2.run(_raise_on_rank1_while_rank0_waits)
    # rank 0 is stuck in the barrier; the pool must not wait for the 120 s pool timeout
    assert time.monotonic() - t0 < 20
    err = info.value
    assert set(err.failures) == {1}
    assert err.pending == [0]
    assert "spam-eggs-42" in str(err) and "ValueError" in str(err)
    assert "rank 1" in str(err)
    assert not pool2.is_running

    infos = pool2.run(_rank_info)
    assert [i["rank"] for i in infos] == [0, 1]
    assert pool2.starts == starts + 1
    assert not set(before) & {i["pid"] for i in infos}, "the failed workers were replaced"
    assert pool2.run(_all_reduce_sum, 2.0) == [[3.0, 6.0], [3.0, 6.0]]


def test_hanging_rank_raises_timeout_then_pool_restarts(pool2, workers):
    starts = pool2.starts
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:  # rank 1 sleeps far past any timeout: a short one cannot flake
        pool2.run(_hang_on_rank1, timeout_s=2)
    elapsed = time.monotonic() - t0
    assert 1.8 < elapsed < 12
    assert isinstance(info.value, workers.RankTimeout)
    assert info.value.pending == [0, 1]
    assert not pool2.is_running

    assert pool2.run(_all_reduce_sum, 1.0) == [[3.0, 3.0], [3.0, 3.0]]
    assert pool2.starts == starts + 1


def test_dead_worker_fails_fast_with_exit_code_and_closed_pool_refuses(workers):
    with workers.RankPool(2, timeout_s=60) as pool:
        t0 = time.monotonic()
        with pytest.raises(workers.RankFailure) as info:
            pool.run(_die_on_rank1_raise_on_rank0)
        assert time.monotonic() - t0 < 20
        err = info.value
        assert set(err.failures) == {0, 1}  # every failing rank is reported
        assert "exit code 7" in err.failures[1]
        assert "ham-99" in err.failures[0]
        assert "exit code 7" in str(err) and "ham-99" in str(err)
    assert pool.closed and not pool.is_running
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_rank_info)
