"""Local backend: run ``torchrun`` as a subprocess of the Airflow task and stream its output.

torchrun (``torch.distributed.run``) is the launcher; this module only builds its command line,
forwards its output line by line into the task log, and makes sure no rank outlives the task.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    pass


@dataclass
class LaunchResult:
    returncode: int
    wall_s: float
    tail: list[str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(*, nproc: int, config_path: str | Path, max_restarts: int, port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "--max-restarts", str(max_restarts),
        "-m", "training", "train", "--config", str(config_path),
    ]


def rank_env(nproc: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback only; nccl ignores it
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_streaming(cmd: list[str], *, env: dict[str, str], cwd: str | Path, tail_lines: int = 60) -> LaunchResult:
    """Run ``cmd`` in its own process group, log each output line, kill the group on exit."""
    log.info("launching: %s", " ".join(cmd))
    t0 = time.perf_counter()
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log.info("%s", line)
        rc = proc.wait()
    finally:
        # The task may be stopped (timeout, mark-failed, SIGTERM): never leave ranks behind.
        if proc.poll() is None:
            _stop_group(proc)
    return LaunchResult(returncode=rc, wall_s=time.perf_counter() - t0, tail=list(tail))


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def explain_failure(result: LaunchResult) -> str:
    """Pick the lines a person needs: the Python error of the failing rank and torchrun's summary."""
    errors = [l for l in result.tail if "Error" in l or "error:" in l or "exitcode" in l or "rank" in l.lower()]
    picked = errors[-12:] or result.tail[-12:]
    return (f"torchrun exited with code {result.returncode} after {result.wall_s:.1f}s. Last relevant lines:\n  "
            + "\n  ".join(picked))
