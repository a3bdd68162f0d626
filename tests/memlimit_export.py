"""A process under a memory limit the way a container runtime sets a pod's: a cgroup (v1 memory
controller, as root) with ``memory.limit_in_bytes``, the process placed in it before it execs
(``cgroup.procs``), so everything it maps and the page cache it fills count; the group is removed
after. Used by the bounded-export test."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    return os.geteuid() == 0 and (ROOT / "cgroup.procs").is_file()


class MemoryGroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text())

    def set_limit(self, limit: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes")

    def max_usage(self) -> int:
        return self._read("memory.max_usage_in_bytes")

    def reset_max(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        procs = str(self.path / "cgroup.procs")

        def join() -> None:  # in the child, before exec: what runc does for a container's init
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.Popen(cmd, preexec_fn=join, **kwargs)


@contextlib.contextmanager
def memory_group(prefix: str = "test-export"):
    path = ROOT / f"{prefix}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield MemoryGroup(path)
    finally:
        path.rmdir()  # its processes have exited; the kernel drops its charges with it
