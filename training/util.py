"""Small helpers written once for the package, its tests and benchmarks: a free loopback port,
waiting for a port to listen, an atomic file write, the sha256 of a file (and through the machine's
cache of verified digests) and the folder for what is kept between runs on this machine."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections import Counter
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


DIGEST_CACHE_ENV = "TRAINING_DIGEST_CACHE"  # "off": hash every file on every open
RACY_NS = 1_000_000_000  # a file changed this recently is not recorded: a rewrite in the same clock tick keeps its stat
digest_counts: Counter[str] = Counter()  # this process's "hit" / "hashed" of sha256_cached


def _identity(st: os.stat_result) -> list[int]:
    # ctime cannot be set by a user: an in-place rewrite to the same size and mtime still changes it
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_cached(path: str | Path) -> str:
    """The sha256 of a file's bytes, as ``sha256_file``, without reading it again while it is the
    same file: ``machine_cache_dir()/digests`` keeps, per real path, the digest with the file's stat
    identity (device, inode, size, mtime and ctime in ns); a file whose stat differs is hashed again.
    A lock per file: the ranks of a machine opening at once hash it once. ``TRAINING_DIGEST_CACHE=off``
    hashes every time."""
    real = os.path.realpath(path)
    if os.environ.get(DIGEST_CACHE_ENV, "").lower() in ("0", "off", "false", "no"):
        digest_counts["hashed"] += 1
        return sha256_file(real)
    from filelock import FileLock

    entry = machine_cache_dir() / "digests" / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(entry) + ".lock")
        lock.acquire()
    except OSError as e:  # a read-only or full cache: correct, only slower
        logging.getLogger(__name__).warning("digest cache %s not usable (%s): hashing %s", entry.parent, e, real)
        digest_counts["hashed"] += 1
        return sha256_file(real)
    try:
        now = time.time_ns()
        before = _identity(os.stat(real))
        try:
            kept = json.loads(entry.read_text())
            if kept["path"] == real and kept["stat"] == before:
                digest_counts["hit"] += 1
                return kept["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        digest = sha256_file(real)
        digest_counts["hashed"] += 1
        if _identity(os.stat(real)) == before and now - max(before[3], before[4]) > RACY_NS:
            try:
                atomic_write(entry, json.dumps({"path": real, "stat": before, "sha256": digest}),
                             tmp_suffix=f".{os.getpid()}.tmp")
            except OSError as e:
                logging.getLogger(__name__).warning("digest of %s not kept in %s (%s)", real, entry.parent, e)
        return digest
    finally:
        lock.release()
