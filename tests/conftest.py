"""Shared pytest fixtures.

Multi-rank tests must go through the shared rank pools below (``pool2``, ``pool4`` or
``rank_pool(world_size)``) instead of spawning their own processes or process groups: starting
workers costs seconds (importing torch, diffusers and paradiff), so one
:class:`rank_workers.RankPool` per world size serves the whole session (of each xdist worker), its workers
forked from a server that imported them once.

Task functions passed to ``pool.run`` must be module-level functions (of the test module is fine:
workers get the parent's ``sys.path``, which includes this directory under pytest's default
``prepend`` import mode) and must take their rank from ``torch.distributed.get_rank()``. Keep
results small (numbers, lists, numpy arrays). A failing or hanging task makes the pool restart
its workers on the next ``run``, so one broken test does not break the ones after it.
"""

from __future__ import annotations

import os

import pytest
import torch

from paradiff.cli.argument_checks import threads_per_rank

#: The suite runs on pytest-xdist workers (``-n`` in pyproject.toml), which share the machine's cores as the CLI's ranks
#: do: each worker's torch computes on its share, where every worker's default (all cores) would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(threads_per_rank(None, int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

#: The lines tests reported through the ``report`` fixture, gathered where the run's summary is printed.
REPORTED: list[str] = []


@pytest.fixture
def report(record_property):
    """``report(line)`` prints ``line`` in the run's summary, whatever the test's outcome: a test's printed output
    stays in its xdist worker, while its recorded properties travel with its result to the summary."""
    return lambda line: record_property("report", line)


def pytest_runtest_logreport(report):
    if report.when == "call":
        REPORTED.extend(value for name, value in report.user_properties if name == "report")


def pytest_terminal_summary(terminalreporter):
    if REPORTED:
        terminalreporter.section("reported by the tests")
        for line in REPORTED:
            terminalreporter.write_line(line)


#: What nearly every pool task imports (the library, its tiny test pipelines, the built-in models' loading): the
#: pools' fork server imports it once, where each spawned worker would import it again at every (re)start.
POOL_PRELOAD = ("paradiff.pipeline", "paradiff.tiny", "paradiff.loading")


@pytest.fixture(autouse=True)
def torch_threads_as_found():
    """Each test leaves this process's torch thread count as it found it: the CLI's rank functions, run here by
    ``ranks_here``, set one thread per rank, which would halve every later test's compute on 2 cores."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def rank_pool():
    """Factory ``rank_pool(world_size)`` returning a session-wide pool for that world size."""
    from rank_workers import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or pool.closed:
            pool = pools[world_size] = RankPool(world_size, preload=POOL_PRELOAD)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def pool2(rank_pool):
    """A session-wide pool of 2 gloo ranks."""
    return rank_pool(2)


@pytest.fixture(scope="session")
def pool4(rank_pool):
    """A session-wide pool of 4 gloo ranks."""
    return rank_pool(4)


@pytest.fixture
def ranks_here(monkeypatch):
    """The CLI's ranks' function runs in this process, and making a process group fails the test: for the refusals
    the ranks make before they load anything or talk to one another."""
    import paradiff.bench.run
    import paradiff.cli
    import paradiff.runtime.distributed

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was made")

    monkeypatch.setattr(paradiff.runtime.distributed, "ensure_process_group", no_group)
    monkeypatch.setattr(paradiff.bench.run, "ensure_process_group", no_group)
    monkeypatch.setattr(paradiff.cli, "run_on_ranks", lambda fn, nproc, *args, **kwargs: fn(*args))
