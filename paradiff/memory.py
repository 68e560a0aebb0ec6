"""Peak memory of this rank over a stretch of work: on CUDA the allocator's peak, on the CPU the process's peak
resident set (Linux: ``VmHWM``, reset through ``/proc/self/clear_refs``)."""

from __future__ import annotations

from pathlib import Path

import torch

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``: the most memory held during the block (on
    the CPU the whole process's resident memory, which includes what it held before), or None where the system
    does not say."""

    def __init__(self, device: torch.device):
        self.device, self.bytes, self.reset = torch.device(device), None, False

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                _CLEAR_REFS.write_text("5")  # the peak resident set starts again from the current one
                self.reset = True
            except OSError:
                self.reset = False  # the process's peak since it started would not be this block's
        return self

    def __exit__(self, *_) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        elif self.reset:
            self.bytes = _status_bytes("VmHWM")
