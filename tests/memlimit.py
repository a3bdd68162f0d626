"""A memory limit on a process tree, set as the container runtime sets a pod's: a cgroup v1
memory group (``/sys/fs/cgroup/memory/<name>``) whose ``memory.limit_in_bytes`` is the limit; a
process started in it (and every child it forks) is charged there, and the kernel's OOM killer
ends it past the limit. Needs root and the v1 memory controller; ``available()`` says."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    return os.geteuid() == 0 and (ROOT / "memory.limit_in_bytes").is_file() and os.access(ROOT, os.W_OK)


class MemoryGroup:
    """``with MemoryGroup(name, limit) as g:`` a fresh group (removed on exit, its processes killed
    first); ``g.enter`` is a ``preexec_fn`` that puts the child in it before it runs anything."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.path = ROOT / f"{name}-{os.getpid()}"
        self.limit = limit_bytes

    def __enter__(self) -> "MemoryGroup":
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        (self.path / "memory.swappiness").write_text("0")
        return self

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def read(self, name: str) -> int:
        return int((self.path / f"memory.{name}").read_text().split()[0])

    @property
    def peak(self) -> int:
        """The most the group was charged (resident memory and the page cache of files written)."""
        return self.read("max_usage_in_bytes")

    def set_limit(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def reset_peak(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    @property
    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def __exit__(self, *exc) -> None:
        for _ in range(50):
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # busy for a moment after its last process exits
                time.sleep(0.1)


def torchrun_in(group: MemoryGroup, sets: dict, *, env: dict | None = None, max_restarts: int = 0,
                nproc: int = 2) -> subprocess.CompletedProcess:
    """The trainer under torchrun (``--set`` each of ``sets``, ``nproc`` gloo ranks), the agent and
    its ranks in ``group``; asserts it exits 0."""
    from training.distributed.launch import torchrun_command
    from training.util import free_port

    cmd = torchrun_command([a for k, v in sets.items() for a in ("--set", f"{k}={v}")], nproc_per_node=nproc,
                           master_port=free_port(), max_restarts=max_restarts)
    full_env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}, "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full_env, preexec_fn=group.enter)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def run_once_ready(name: str, argv: list[str], budget: int, timeout: float = 120) -> tuple[int, str, int, int]:
    """Run ``argv`` in a fresh memory group whose limit is set once the child prints ``ready`` (its
    interpreter and libraries loaded) to what the group uses then + ``budget``; the child goes on
    when it reads a line. Returns its exit code, output, the limit and the group's peak after it."""
    with MemoryGroup(name, 64 << 30) as group:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=group.enter)
        try:
            for line in proc.stdout:  # past the warnings of the imports
                if line.strip() == "ready":
                    break
            else:
                return proc.wait(timeout=timeout), "never ready", 0, group.peak
            limit = group.read("usage_in_bytes") + budget
            group.set_limit(limit)
            group.reset_peak()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            output = proc.stdout.read()
            return proc.wait(timeout=timeout), output, limit, group.peak
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
