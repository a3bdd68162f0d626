"""The ``file://`` store: a local folder laid out exactly like a bucket."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import IO, Any, Iterator

from training.store.base import ObjectMissing, StoreError
from training.util import atomic_write, sha256_file


class FileStore:
    """A local folder laid out exactly like the bucket. Writes are tmp + fsync + rename."""

    def __init__(self, root: str | Path, field: str = "store_uri"):
        self.root = Path(root)
        self.uri = self.root.resolve().as_uri()
        self.field = field

    def _path(self, key: str) -> Path:
        return self.root / key

    def local_path(self, key: str) -> Path | None:
        """Where ``key`` lives on this machine: a folder store is read and written in place."""
        return self._path(key)

    def put_file(self, local: str | Path, key: str, sha256: str) -> None:
        dest = self._path(key)
        if Path(local).resolve() == dest.resolve():  # written in place (and fsynced) already
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        shutil.copyfile(local, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def put_bytes(self, data: bytes, key: str) -> None:
        atomic_write(self._path(key), data, tmp_suffix=".partial")

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[IO[bytes]]:
        """A file written front to back; it appears under ``key`` (fsynced) only once complete."""
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def get_file(self, key: str, local: str | Path) -> None:
        try:
            shutil.copyfile(self._path(key), local)
        except FileNotFoundError:
            raise ObjectMissing(f"{key} is missing from {self.uri}") from None

    def stat(self, key: str) -> dict[str, Any] | None:
        p = self._path(key)
        return {"size": p.stat().st_size} if p.is_file() else None

    def sha256(self, key: str) -> str | None:
        p = self._path(key)
        return sha256_file(p) if p.is_file() else None

    def list_dirs(self, prefix: str) -> list[str]:
        p = self._path(prefix)
        return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []

    def list_keys(self, prefix: str) -> list[str]:
        p = self._path(prefix)
        return sorted(f.relative_to(self.root).as_posix() for f in p.rglob("*") if f.is_file()) if p.is_dir() else []

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self._path(k).unlink(missing_ok=True)
        for d in sorted({self._path(k).parent for k in keys}, key=lambda x: len(x.parts), reverse=True):
            try:
                d.rmdir()  # only once empty
            except OSError:
                pass

    def check_access(self, prefix: str) -> None:
        """Refuse a folder this process could not create or write, before anything is computed
        (without creating it: the nearest existing folder above it must be a writable folder)."""
        target = self._path(prefix).absolute()
        existing = next(p for p in (target, *target.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise StoreError(f"cannot write to the folder {target} ({existing} is not a writable folder); fix "
                             f"{self.field} or the folder's permissions", bad_input=True)
