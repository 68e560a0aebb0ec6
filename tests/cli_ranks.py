"""``paradiff.cli.main`` on every rank of a shared pool, as under ``torchrun``: the CLI's launch mode for a process
group that already exists, so a test of a command pays for its model's work, not for starting two workers."""

from __future__ import annotations

import contextlib
import io
import os


@contextlib.contextmanager
def as_torchrun_rank(cwd: str | None = None, env: dict | None = None):
    """This pool rank with the variables torchrun sets (``RANK``, ``WORLD_SIZE`` and their local twins) and ``env``,
    in the folder ``cwd`` (None: where the rank is); the environment and folder come back after."""
    import torch.distributed as dist

    saved = dict(os.environ), os.getcwd()
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, **(env or {}))
    try:
        os.chdir(cwd or saved[1])
        yield
    finally:
        os.chdir(saved[1])
        os.environ.clear()
        os.environ.update(saved[0])


def _cli_on_rank(argv: list[str], cwd: str | None, env: dict | None = None) -> tuple[int, str, str]:
    """``paradiff <argv>`` on this rank as torchrun would start it, in ``cwd`` with ``env``; its exit code, stdout and
    stderr."""
    from paradiff.cli import main

    out, err = io.StringIO(), io.StringIO()
    with as_torchrun_rank(cwd, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse's --version, --help and parse errors
            code = exit_info.code if isinstance(exit_info.code, int) else int(exit_info.code is not None)
    return code, out.getvalue(), err.getvalue()


def cli_on_ranks(pool, *argv: str, cwd: str | None = None, env: dict | None = None) -> tuple[int, str, str]:
    """Rank 0's exit code, stdout and stderr of ``paradiff <argv>`` (run in ``cwd``, with ``env`` set); every rank
    must exit with the same code."""
    results = pool.run(_cli_on_rank, list(argv), cwd, env, timeout_s=240)
    assert len({code for code, _, _ in results}) == 1, results
    return results[0]
