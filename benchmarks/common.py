"""Helpers every benchmark shares: what machine it ran on, and how busy the rest of it was."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "multi30k"  # Multi30k beside the checkout, as CI finds it
DEFAULT_MODEL = REPO / "artifacts" / "multi30k-de-en"  # the shipped model


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_busy_seconds() -> float | None:
    """CPU-seconds spent busy by the whole machine since boot (Linux /proc/stat), or None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU time that other processes took during the benchmark: on a shared machine they slow it
    down, and the load average cannot tell them from this process. Reported with the results."""

    def __enter__(self) -> OtherLoad:
        self.start_busy, self.start_own, self.start_wall = cpu_busy_seconds(), os.times(), time.perf_counter()
        self.cpu_seconds: float | None = None
        self.fraction: float | None = None  # of the machine's CPU capacity over the run
        return self

    def __exit__(self, *exc: object) -> None:
        end_busy, end_own = cpu_busy_seconds(), os.times()
        if self.start_busy is None or end_busy is None:
            return
        own = (end_own.user + end_own.system) - (self.start_own.user + self.start_own.system)
        self.cpu_seconds = max(0.0, end_busy - self.start_busy - own)
        capacity = (time.perf_counter() - self.start_wall) * (os.cpu_count() or 1)
        self.fraction = self.cpu_seconds / capacity
