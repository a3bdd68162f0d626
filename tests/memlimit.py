"""A memory limit for a test's child processes, set the way a container runtime sets a pod's memory
limit: a cgroup v1 memory group (as root: ``mkdir /sys/fs/cgroup/memory/<name>``, the limit in
``memory.limit_in_bytes``, the process's pid in ``cgroup.procs``; its children inherit the group).
Going over it gets a process OOM-killed, as in a pod. The group is removed afterwards."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Iterator

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    """Root, and the cgroup v1 memory controller mounted."""
    return os.geteuid() == 0 and (ROOT / "memory.limit_in_bytes").is_file()


class MemoryGroup:
    def __init__(self, path: Path):
        self.path = path

    def join(self) -> None:
        """Put the calling process in the group: ``preexec_fn=group.join`` for a child."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    @property
    def peak(self) -> int:
        return self.read("memory.max_usage_in_bytes")

    @property
    def oom_kills(self) -> int:
        stats = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return int(stats.get("oom_kill", 0))


@contextlib.contextmanager
def memory_limit(limit_bytes: int, name: str = "") -> Iterator[MemoryGroup]:
    """A fresh memory group limited to ``limit_bytes`` (swap included when the kernel accounts it)."""
    path = ROOT / f"test-{name or 'mem'}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        if (path / "memory.memsw.limit_in_bytes").is_file():  # no swap past the limit either
            (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield MemoryGroup(path)
    finally:
        for _ in range(50):  # the group can go once its processes have exited
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
                path.rmdir()
                break
            time.sleep(0.1)
