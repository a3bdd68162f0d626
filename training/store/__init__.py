"""Object stores: one small interface (``Store``, ``store/base.py``) for ``file://`` folders
(``store/file.py``) and ``s3://`` buckets (``store/s3.py``), and ``open_store``, which picks one
from a URI (``check_writable`` tries it once, before anything is computed). Data reading and the
checkpoint code build on it and never ask which store they have. Imports ``config`` and ``util`` only.
"""

from __future__ import annotations

from typing import Mapping
from urllib.parse import urlparse

from training.config.fields import ConfigError
from training.config.train_config import check_path_part
from training.store.base import ObjectMissing, Store, StoreError
from training.store.file import FileStore
from training.store.s3 import S3Store

__all__ = ["ObjectMissing", "Store", "StoreError", "FileStore", "S3Store", "open_store", "check_writable"]


def open_store(uri: str, env: Mapping[str, str] | None = None, *, field: str = "store_uri") -> FileStore | S3Store:
    """The store behind ``uri`` (``file:///folder``, a plain folder, or ``s3://bucket/prefix``).
    ``env``: S3 settings that override the process environment; ``field``: the config field the
    URI came from, named in every error."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return FileStore(parsed.path, field)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError(field, f"{uri!r} names no bucket", "write s3://BUCKET/optional/prefix")
        for part in filter(None, parsed.path.split("/")):
            check_path_part(field, part)
        return S3Store(parsed.netloc, parsed.path, env, field)
    if parsed.scheme == "" and uri:
        return FileStore(uri, field)
    raise ConfigError(field, f"scheme {parsed.scheme!r} of {uri!r} is not supported",
                      "use file:///absolute/folder or s3://bucket/prefix")


def check_writable(uri: str, env: Mapping[str, str] | None = None, *, field: str) -> Store:
    """List and write the location ``uri`` (config field ``field``) once, before anything is
    computed. A missing bucket, keys that are wrong or denied, an unwritable folder are bad input:
    ConfigError naming the field, the bucket (or folder) and the operation, never a credential. An
    unreachable endpoint is an outage a retry may outlive: StoreError."""
    store = open_store(uri, env, field=field)
    try:
        store.check_access("")
    except StoreError as e:
        if not e.bad_input:
            raise
        raise ConfigError(field, str(e), "nothing was started; fix the location or its access, then run again") from None
    return store
