"""``paradiff serve`` in a subprocess, on a free loopback port, always stopped: for the server's tests and benchmark.

:class:`ServerProcess` starts ``python -m paradiff.cli serve ... --port 0``, reads the address it printed, and
waits until ``/health`` says ready. Its ranks are found by their environment (``RANK``) among the server's
children. Stopping sends SIGTERM and waits; whatever is left is killed, the ranks included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
#: Seconds a server may take to load its model here (2 ranks sharing 2 busy cores).
READY_S = 240.0


class ServerProcess:
    """``paradiff serve ARGS --port 0``; with ``torchrun=N``, on N ranks that ``torchrun`` starts (rank 0 answers)."""

    def __init__(self, *args: str, key: str | None = None, env: dict | None = None, torchrun: int | None = None):
        command = [sys.executable, "-m", "paradiff.cli", "serve", *args, "--port", "0"]
        if torchrun is not None:
            launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "--max-restarts", "0"]
            launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
            command = [sys.executable, *launcher, *command[1:]]
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
        environment.pop("PARADIFF_API_KEY", None)
        if key is not None:
            environment["PARADIFF_API_KEY"] = key
        self.key = key
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, start_new_session=True
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        first = self.process.stdout.readline()
        self.lines.append(first)
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.errors), daemon=True).start()
        if "listening on " not in first:
            self.kill()
            raise RuntimeError(f"the server did not start: {first!r} {''.join(self.errors)[-2000:]}")
        self.url = first.split("listening on ")[1].strip()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, timeout=300, headers=headers)

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_ready(self, within_s: float = READY_S) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited {self.process.returncode}: {''.join(self.errors)[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get("/health").json()["status"] == "ready":
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready within {within_s:g} s: {''.join(self.errors)[-2000:]}")

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metric(self, line_start: str) -> float:
        """The value of the metrics line that starts with ``line_start`` (e.g. ``paradiff_requests_total{...}``)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        raise KeyError(line_start)

    def ranks(self) -> dict[int, psutil.Process]:
        """The rank processes, by rank."""
        found = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "paradiff.launch.worker" in " ".join(child.cmdline()):
                    found[int(child.environ()["RANK"])] = child
        return found

    def processes(self) -> list[psutil.Process]:
        """The server's process and its ranks."""
        return [psutil.Process(self.process.pid), *self.ranks().values()]

    def stop(self, within_s: float = 120) -> int:
        """SIGTERM, then the exit status (killed after ``within_s``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(within_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill the server and its ranks, whatever state they are in."""
        with contextlib.suppress(psutil.Error):
            family = [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
            for process in family:
                with contextlib.suppress(psutil.Error):
                    process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self.http.close()
