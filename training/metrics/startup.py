"""Where a rank's start-up goes, from its process start to its first training step.

``StartupClock`` is started when the process starts (the kernel's start time of this process,
so the interpreter and the imports count too); the trainer marks the end of each phase: imports,
data, process group, model, MLflow, resume, peak FLOP/s. Rank 0 logs them as ``startup/<phase>_s``
(step 0) and prints one ``startup:`` line, so a slow start names its cause in every run
(benchmarks/startup_bench.py reads the line; docs/benchmarks.md has the breakdown).
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float | None:
    """Wall-clock time (``time.time()``) this process started, from ``/proc`` (Linux, 10 ms
    resolution); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may contain spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, age)


class StartupClock:
    """Seconds per start-up phase, each from the end of the previous one."""

    def __init__(self) -> None:
        now = time.time()
        self.start = process_start_time() or now
        self._last = self.start
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """The phase ``phase`` ended now (a phase marked twice adds up)."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self.start

    def metrics(self) -> dict[str, float]:
        return {**{f"startup/{k}_s": v for k, v in self.phases.items()}, "startup/total_s": self.total}

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())
        return f"startup: {self.total:.2f}s from process start to the first step ({parts})"
