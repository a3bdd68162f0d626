"""A memory limit as a container runtime sets a pod's: a cgroup v1 memory group (as root) below
this process's own, ``memory.limit_in_bytes`` written, and the launched process moved into it
(``cgroup.procs``) before it execs, so torchrun and every rank it starts run under the limit and
read it back from ``/proc/self/cgroup``. Removed afterwards. Fails the test clearly where it cannot
be made (not root, no v1 memory controller)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/memory")


class MemoryLimit:
    """``with MemoryLimit(bytes) as cg: subprocess.run(..., preexec_fn=cg.enter)``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = int(limit_bytes)
        self.path: Path | None = None

    def __enter__(self) -> "MemoryLimit":
        if not (V1 / "memory.limit_in_bytes").exists():
            pytest.fail(f"no cgroup v1 memory controller at {V1}: these tests set a pod's memory limit through it")
        if os.geteuid() != 0:
            pytest.fail("setting a memory cgroup limit needs root (as the container runtime has)")
        own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if "memory" in line.split(":", 2)[1].split(",")), "/")
        parent = V1 / own.lstrip("/")
        parent = parent if parent.is_dir() else V1
        self.path = parent / f"dts-test-{uuid.uuid4().hex[:12]}"
        try:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        except OSError as e:
            pytest.fail(f"could not make the memory cgroup {self.path}: {e}")
        return self

    def enter(self) -> None:
        """``preexec_fn``: move the child (before it execs) into the group."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    @property
    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    @property
    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        for _ in range(50):  # the group can go once its last process has exited
            procs = (self.path / "cgroup.procs").read_text().split()
            if not procs:
                break
            time.sleep(0.1)
        try:
            self.path.rmdir()
        except OSError as e:
            pytest.fail(f"could not remove the memory cgroup {self.path}: {e}")
