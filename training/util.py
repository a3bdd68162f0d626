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


def return_large_frees(threshold: int = 4 << 20) -> None:
    """Make glibc's malloc serve blocks of ``threshold`` bytes or more with their own mappings and
    give freed memory back to the system, so a rank's resident memory follows what it holds (by
    default glibc raises its mmap threshold up to 32 MiB as blocks are freed and keeps the freed
    tensors' memory in its arenas: peaks then depend on the order of frees). No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return
    if mallopt is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
        mallopt(m_mmap_threshold, threshold)
        mallopt(m_trim_threshold, threshold)
