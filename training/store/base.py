"""What every store offers (``Store``) and how it fails (``StoreError``, ``ObjectMissing``).

Errors name the bucket or folder and the operation, never a credential; ``bad_input`` tells a
mistake a person must fix (no such bucket, access denied, no credentials, an unwritable folder)
from an outage a retry may cure.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import IO, Any, Protocol

class StoreError(RuntimeError):
    """A store problem a user can act on; the message says what to do. ``bad_input``: a mistake in
    the settings (no such bucket, access denied, no credentials), which no retry fixes."""

    def __init__(self, message: str, *, bad_input: bool = False):
        super().__init__(message)
        self.bad_input = bad_input


class ObjectMissing(StoreError):
    """The key names no object (``get_file`` of a key that is not there)."""


class Store(Protocol):
    """What the commit protocol and the checkpoint reader/writer need of a store. Keys are
    ``/``-separated, relative to the store's root (``uri``)."""

    uri: str

    def put_file(self, local: str | Path, key: str, sha256: str) -> None: ...
    def put_bytes(self, data: bytes, key: str) -> None: ...
    def open_write(self, key: str) -> contextlib.AbstractContextManager[IO[bytes]]: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def get_file(self, key: str, local: str | Path) -> None: ...
    def local_path(self, key: str) -> Path | None: ...
    def stat(self, key: str) -> dict[str, Any] | None: ...
    def sha256(self, key: str) -> str | None: ...
    def list_dirs(self, prefix: str) -> list[str]: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete(self, keys: list[str]) -> None: ...
    def check_access(self, prefix: str) -> None: ...


