"""Where a dataset's rows come from: ``discover`` resolves ``dataset_uri`` (a local folder or
Parquet file, or ``s3://bucket/prefix``) to a ``Layout``: the Parquet files of each split, a local
copy of each with its sha256, and the data ``fingerprint`` over them; ``read_files`` reads a split.

Layouts, tried in this order (none needs a metadata file; a root ``dataset.json`` only describes
the data, training/data/schema.py): 1. ``train/`` and ``validation/`` (or ``val/``) sub-folders of
Parquet files; 2. files side by side named ``train*`` and ``val*``/``validation*``; 3. one table
(a Parquet file or a folder of parts), split by training/data/split.py. A missing ``dataset_uri``
raises ConfigError; an unusable layout lists its ``problems`` (``Layout.require`` raises).
S3 objects are fetched whole into a per-machine cache (``TRAINING_DATA_CACHE``, safe to delete):
docs/decisions/0004-s3-data-whole-objects-cached.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from filelock import FileLock

from training.config.fields import ConfigError
from training.data.options import DataOptions
from training.util import sha256_cached

META_FILE = "dataset.json"
SPLITS = ("train", "validation")
TABLE = "table"  # the files of a one-table layout, before the split
_TRAIN_NAME = re.compile(r"^train(?:[._-]|$)", re.IGNORECASE)
_VAL_NAME = re.compile(r"^val(?:idation)?(?:[._-]|$)", re.IGNORECASE)


@dataclass
class DataFile:
    path: str  # relative to the dataset root: the file's name in the fingerprint and in messages
    local: Path  # where it is read from (the file itself, or its cached copy)
    size: int
    sha256: str


@dataclass
class Layout:
    """The files of each split (``train`` / ``validation``, or ``table`` for one table to split)."""

    uri: str
    style: str  # "folders", "prefixed" or "one table"
    files: dict[str, list[DataFile]]
    meta: dict[str, Any] | None = None  # dataset.json, when there is one
    ignored: list[str] = field(default_factory=list)  # Parquet files no split takes
    problems: list[str] = field(default_factory=list)  # one line each: why there is no usable layout

    @property
    def all_files(self) -> list[DataFile]:
        return sorted((f for fs in self.files.values() for f in fs), key=lambda f: f.path)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.all_files)

    def require(self) -> "Layout":
        if self.problems:
            raise ConfigError("dataset_uri", "; ".join(self.problems), _LAYOUT_FIX)
        return self

    def summary(self, options: DataOptions) -> dict[str, Any]:
        """What the run records about where its rows came from."""
        out: dict[str, Any] = {"dataset_uri": self.uri, "layout": self.style,
                               "files": {k: [f.path for f in v] for k, v in self.files.items()}}
        if TABLE in self.files:
            out["split"] = {"rule": "hash of each row's values, mixed with split_seed, below validation_fraction",
                            "validation_fraction": options.validation_fraction, "split_seed": options.split_seed}
        if self.ignored:
            out["ignored"] = self.ignored
        return out


_LAYOUT_FIX = ("give a folder with train/ and validation/ (or val/) sub-folders of Parquet files, files named "
               "train* and val*/validation* side by side, or one table (a Parquet file or a folder of parts) to split "
               "by validation_fraction")


def fingerprint(files: list[Any]) -> str:
    """One sha256 over every data file's relative path and sha256: what exactly was read."""
    h = hashlib.sha256()
    for f in files:
        path, digest = (f["path"], f["sha256"]) if isinstance(f, dict) else (f.path, f.sha256)
        h.update(f"{path}\0{digest}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- layout


def _choose(names: list[str], where) -> tuple[str, dict[str, list[str]], list[str], list[str]]:
    """(style, split -> relative paths, ignored, problems) from every Parquet file's relative path;
    ``where(folder)`` names a place under the root in a message."""
    def under(*folders: str) -> list[str]:
        return [n for n in names if n.split("/", 1)[0].lower() in folders and "/" in n]

    top = [n for n in names if "/" not in n]
    train = under("train", "training")
    if train:
        val = under("validation", "val", "valid")
        taken = set(train) | set(val)
        problems = [] if val else [f"validation: no Parquet files under {where('validation')} (nor {where('val')})"]
        return "folders", {"train": train, "validation": val}, [n for n in names if n not in taken], problems
    train = [n for n in top if _TRAIN_NAME.match(n)]
    val = [n for n in top if _VAL_NAME.match(n)]
    if train or val:
        problems = ([] if train else [f"train: no Parquet file named train* beside the val* files in {where('')}"]) + (
            [] if val else [f"validation: no Parquet file named val* or validation* beside the train* files in "
                            f"{where('')}"])
        taken = set(train) | set(val)
        return "prefixed", {"train": train, "validation": val}, [n for n in names if n not in taken], problems
    if not names:
        return "one table", {TABLE: []}, [], [f"no Parquet files under {where('')}"]
    return "one table", {TABLE: names}, [], []


def discover(uri: str, *, env: Mapping[str, str] | None = None) -> Layout:
    """List ``uri``, pick the layout, read ``dataset.json``, and make every data file local
    (S3: through the cache) with its sha256. Raises ConfigError when ``uri`` does not exist;
    a layout without a usable train/validation pair has ``problems`` (see ``Layout.require``)."""
    if uri.startswith("s3://"):
        return _S3Source(uri, env).layout()
    return _local_layout(uri)


def _local_layout(uri: str) -> Layout:
    root = Path(uri.removeprefix("file://"))
    if root.is_file():
        if root.suffix != ".parquet":
            raise ConfigError("dataset_uri", f"{uri} is a file but not a Parquet file (.parquet)", _LAYOUT_FIX)
        return Layout(uri=uri, style="one table", files={TABLE: [_local_file(root.name, root)]})
    if not root.is_dir():
        raise ConfigError("dataset_uri", f"{uri} does not exist", "give an existing folder, Parquet file or s3:// prefix")
    names = sorted((Path(d) / f).relative_to(root).as_posix()  # symlinked folders too
                   for d, _, files in os.walk(root, followlinks=True) for f in files if f.endswith(".parquet"))
    meta_path = root / META_FILE
    meta = _parse_meta(meta_path.read_bytes(), str(meta_path)) if meta_path.is_file() else None
    style, chosen, ignored, problems = _choose(names, lambda folder: root / folder if folder else root)
    layout = Layout(uri=uri, style=style, files={}, meta=meta, ignored=ignored, problems=problems)
    if not problems:
        layout.files = {k: [_local_file(n, root / n) for n in v] for k, v in chosen.items()}
    return layout


def _local_file(path: str, local: Path) -> DataFile:
    return DataFile(path=path, local=local, size=local.stat().st_size, sha256=sha256_cached(local))


def _parse_meta(raw: bytes, where: str) -> dict[str, Any]:
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise ConfigError("dataset_uri", f"{where} is not valid JSON ({e})", "fix or remove dataset.json") from None
    if not isinstance(meta, dict):
        raise ConfigError("dataset_uri", f"{where} is not a JSON object", "fix or remove dataset.json")
    return meta


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("TRAINING_DATA_CACHE") or Path(base) / "airflow-distributed-training" / "data")


class _S3Source:
    """An ``s3://bucket/prefix`` dataset through the checkpoint store's boto3 client."""

    def __init__(self, uri: str, env: Mapping[str, str] | None):
        from training.store.s3 import S3Store

        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError("dataset_uri", f"{uri!r} names no bucket", "write s3://BUCKET/prefix")
        self.uri, self.prefix = uri.rstrip("/"), prefix.strip("/")
        self.store = S3Store(bucket, "", env)

    def _list(self, prefix: str) -> list[dict[str, Any]]:
        from botocore.exceptions import ClientError

        def run() -> list[dict[str, Any]] | None:
            pages = self.store.client.get_paginator("list_objects_v2").paginate(Bucket=self.store.bucket, Prefix=prefix)
            try:
                return [o for page in pages for o in page.get("Contents", [])]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    return None
                raise

        # The store's own mapping of the other errors (credentials, endpoint down, dropped connections).
        found = self.store._call(f"list {self.uri}", run)
        if found is None:  # bad input, not a store failure: name the field
            raise ConfigError("dataset_uri", f"bucket '{self.store.bucket}' does not exist",
                              "fix dataset_uri or create the bucket")
        return found

    def layout(self) -> Layout:
        single = [o for o in self._list(self.prefix) if o["Key"] == self.prefix] if self.prefix else []
        if single and self.prefix.endswith(".parquet"):
            obj = single[0]
            name = self.prefix.rsplit("/", 1)[-1]
            return Layout(uri=self.uri, style="one table", files={TABLE: [self._file(name, obj)]})
        base = f"{self.prefix}/" if self.prefix else ""
        objects = {o["Key"][len(base):]: o for o in self._list(base)}
        if not objects:
            raise ConfigError("dataset_uri", f"{self.uri} holds no objects", "fix dataset_uri or upload the data")
        meta = None
        if META_FILE in objects:
            raw = self.store.get_bytes(base + META_FILE)
            meta = _parse_meta(raw or b"", f"{self.uri}/{META_FILE}")
        names = sorted(n for n in objects if n.endswith(".parquet"))
        style, chosen, ignored, problems = _choose(names, lambda folder: f"{self.uri}/{folder}".rstrip("/"))
        layout = Layout(uri=self.uri, style=style, files={}, meta=meta, ignored=ignored, problems=problems)
        if not problems:
            layout.files = {k: [self._file(n, objects[n], base + n) for n in v] for k, v in chosen.items()}
        return layout

    def _file(self, name: str, obj: dict[str, Any], key: str | None = None) -> DataFile:
        local, digest = self._cached(key or obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"'))
        return DataFile(path=name, local=local, size=int(obj["Size"]), sha256=digest)

    def _cached(self, key: str, size: int, etag: str) -> tuple[Path, str]:
        """The local copy of one object and its sha256. A copy is kept with the sha256 of the bytes
        downloaded; a copy whose bytes no longer hash to it (a damaged disk, a stray write) is
        fetched again (an unchanged copy is not read again: ``sha256_cached``)."""
        ident = hashlib.sha256(f"{self.store.endpoint or 'aws'}\0{self.store.bucket}\0{key}\0{etag}\0{size}".encode())
        digest = ident.hexdigest()
        path = cache_dir() / digest[:2] / f"{digest}.parquet"
        sidecar = path.with_name(path.name + ".sha256")
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_name(path.name + ".lock")):  # one download per machine; the others wait
            if path.is_file() and sidecar.is_file():
                actual = sha256_cached(path)
                if actual == sidecar.read_text().strip():
                    return path, actual
            tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
            try:
                self.store._call(f"download {key}", self.store.client.download_file, self.store.bucket, key, str(tmp),
                                 Config=self.store.transfer)
                actual = _verify_download(tmp, size, etag, f"s3://{self.store.bucket}/{key}")
                os.replace(tmp, path)
                sidecar.write_text(actual + "\n")
            finally:
                tmp.unlink(missing_ok=True)
        return path, actual


def _verify_download(path: Path, size: int, etag: str, name: str) -> str:
    """Size as listed, MD5 as the ETag says where it is one (a single-part upload's ETag is the
    MD5 of its bytes); returns the sha256."""
    from training.store.base import StoreError

    if path.stat().st_size != size:
        raise StoreError(f"{name}: downloaded {path.stat().st_size} bytes, the listing said {size}; retry")
    md5, sha = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            md5.update(block)
            sha.update(block)
    if re.fullmatch(r"[0-9a-f]{32}", etag) and md5.hexdigest() != etag:
        raise StoreError(f"{name}: the downloaded bytes do not match the object's ETag (MD5); retry")
    return sha.hexdigest()


# --------------------------------------------------------------------------- reading


def read_files(files: list[DataFile]):
    """One Arrow table from the files of a split (their schemas must agree). ParquetFile rather
    than pq.read_table, whose dataset layer imports pandas (docs/benchmarks.md, "What changed")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for f in files:
        with pq.ParquetFile(str(f.local)) as pf:
            tables.append(pf.read())
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


