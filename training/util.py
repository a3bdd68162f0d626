"""Small helpers written once for the package, its tests and benchmarks: a free loopback port,
waiting for a port to listen, an atomic file write, the sha256 of a file and the folder for
what is kept between runs on this machine."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    """Return once something listens on 127.0.0.1:``port``; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def stop_process(proc, timeout_s: float = 30) -> None:
    """SIGTERM a ``subprocess.Popen``, wait up to ``timeout_s`` for it, then SIGKILL it."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def atomic_write(path: str | Path, data: str | bytes, *, tmp_suffix: str = ".tmp") -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never
    a part: a temporary file beside it (``path`` + ``tmp_suffix``), fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + tmp_suffix)
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def machine_cache_dir() -> Path:
    """Where results worth keeping between runs on this machine live (a measured peak FLOP/s, the
    data gate's verdicts): ``TRAINING_CACHE_DIR``, else ``$XDG_CACHE_HOME/airflow-distributed-training``
    (``~/.cache/...``). Everything in it can be deleted; it is measured or computed again."""
    if os.environ.get("TRAINING_CACHE_DIR"):
        return Path(os.environ["TRAINING_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "airflow-distributed-training"
