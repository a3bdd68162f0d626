"""A background load for checking that timing-sensitive tests hold on a busy machine.

    TEST_BACKGROUND_LOAD=2 .venv/bin/python -m pytest tests/training/test_metrics.py

starts two CPU-bound processes for the whole session (tests/conftest.py), as another 2-process
job on this 2-core machine would be: every rank then competes for a core. ``BackgroundLoad`` is
the same as a context manager for a single test or a benchmark.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal


def _spin() -> None:  # pragma: no cover - runs in the child
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    x = 0
    while True:  # pure Python arithmetic: a whole core, no memory or I/O
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


class BackgroundLoad:
    def __init__(self, processes: int = 2) -> None:
        self.processes = processes
        self._procs: list[mp.Process] = []

    def __enter__(self) -> "BackgroundLoad":
        ctx = mp.get_context("spawn")
        for _ in range(self.processes):
            p = ctx.Process(target=_spin, daemon=True)
            p.start()
            self._procs.append(p)
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []
