"""``paradiff serve``'s process: the HTTP front (uvicorn) and its ranks, until SIGTERM (exit 0) or a failure (1).

With paradiff's launcher this process is the front only (no pipeline): the ranks are its worker processes. Under
``torchrun`` every rank runs this: rank 0 is the front and a rank, the others only ranks.

The listening socket is bound before anything else, so a port in use is said at once (``--port 0`` picks a
free one; the line that says where the server listens names it). SIGTERM stops accepting connections, lets
every accepted request finish, stops the ranks and exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys

from ..errors import ParadiffError
from .settings import ServeSettings


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ParadiffError(
            f"cannot listen on {host}:{port}: {error.strerror or error}; pick another --port"
        ) from error
    listener.listen(2048)
    return listener


def serve(settings: ServeSettings) -> int:
    """Run the server until it is stopped; the exit status."""
    from ..launch import under_torchrun

    if under_torchrun():
        from datetime import timedelta

        import torch.distributed as dist

        from ..runtime.distributed import ensure_process_group

        ensure_process_group(timedelta(seconds=settings.timeout_s))
        if dist.get_rank() != 0:
            return _serve_rank(settings)
    return _serve_front(settings)


def _serve_rank(settings: ServeSettings) -> int:
    """A rank other than 0 under torchrun: draw what rank 0 hands out until it says stop. SIGTERM (torchrun's,
    at shutdown) is left to rank 0, which finishes the accepted requests and then stops every rank."""
    from .ranks import run_ranks

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_ranks(settings, None)
    return 0


def _serve_front(settings: ServeSettings) -> int:
    import uvicorn

    from ..launch import under_torchrun
    from .app import build_app
    from .group import LaunchedRanks, LocalRanks, say
    from .scheduler import Scheduler

    listener = _listen(settings.host, settings.port)
    host, port = listener.getsockname()[:2]
    scheduler = Scheduler(settings)
    ranks = LocalRanks(settings) if under_torchrun() else LaunchedRanks(settings)
    server: uvicorn.Server | None = None

    def stop_server() -> None:
        if server is not None:
            server.should_exit = True

    app = build_app(settings, scheduler, ranks, stop_server)
    config = uvicorn.Config(
        app,
        log_level="info" if settings.verbose else "warning",
        access_log=settings.verbose,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    where = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    ranks_text = "1 rank" if settings.nproc == 1 else f"{settings.nproc} ranks"
    print(
        f"paradiff serve: {settings.model} on {ranks_text} (strategy {settings.strategy}), listening on {where}",
        flush=True,
    )
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn re-raises it after its graceful stop
    try:
        server.run(sockets=[listener])
    finally:
        signal.signal(signal.SIGTERM, previous)
        listener.close()
    if scheduler.refused:  # bad input, as the CLI's other refusals: one line and exit 2
        raise ParadiffError(scheduler.last_error)
    if scheduler.failed:
        say(f"stopped: {scheduler.last_error}")
        return 1
    sys.stdout.flush()
    return 0
