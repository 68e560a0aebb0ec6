"""``paradiff.cli.main`` on every rank of a shared pool, as under ``torchrun``: the CLI's launch mode for a process
group that already exists, so a test of a command pays for its model's work, not for starting two workers."""

from __future__ import annotations

import contextlib
import io
import os


def _cli_on_rank(argv: list[str]) -> tuple[int, str, str]:
    """``paradiff <argv>`` on this rank as torchrun would start it; its exit code, stdout and stderr."""
    import torch.distributed as dist

    from paradiff.cli import main

    saved = dict(os.environ)
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def cli_on_ranks(pool, *argv: str) -> tuple[int, str, str]:
    """Rank 0's exit code, stdout and stderr of ``paradiff <argv>``; every rank must exit with the same code."""
    results = pool.run(_cli_on_rank, list(argv), timeout_s=240)
    assert len({code for code, _, _ in results}) == 1, results
    return results[0]
