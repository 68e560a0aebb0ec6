"""``paradiff.cli.main`` on every rank of a shared pool, as under ``torchrun``: the CLI's launch mode for a process
group that already exists, so a test of a command pays for its model's work, not for starting two workers."""

from __future__ import annotations

import contextlib
import io
import os


def _cli_on_rank(argv: list[str], cwd: str | None) -> tuple[int, str, str]:
    """``paradiff <argv>`` on this rank as torchrun would start it, in the folder ``cwd`` (None: where the rank is);
    its exit code, stdout and stderr."""
    import torch.distributed as dist

    from paradiff.cli import main

    saved = dict(os.environ), os.getcwd()
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    out, err = io.StringIO(), io.StringIO()
    try:
        os.chdir(cwd or saved[1])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exit_info:  # argparse's --version, --help and parse errors
        code = exit_info.code if isinstance(exit_info.code, int) else int(exit_info.code is not None)
    finally:
        os.chdir(saved[1])
        os.environ.clear()
        os.environ.update(saved[0])
    return code, out.getvalue(), err.getvalue()


def cli_on_ranks(pool, *argv: str, cwd: str | None = None) -> tuple[int, str, str]:
    """Rank 0's exit code, stdout and stderr of ``paradiff <argv>`` (run in ``cwd``); every rank must exit with the
    same code."""
    results = pool.run(_cli_on_rank, list(argv), cwd, timeout_s=240)
    assert len({code for code, _, _ in results}) == 1, results
    return results[0]
