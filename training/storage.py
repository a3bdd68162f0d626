"""Checkpoint store: ``file://`` folders and ``s3://`` buckets with the same layout and rules.

Layout::

    {store}/{experiment}/{mlflow_run_id}/step_{step:08d}/<files>
    {store}/{experiment}/{mlflow_run_id}/step_{step:08d}/manifest.json   written after every file
    {store}/{experiment}/{mlflow_run_id}/latest                          written after the manifest

Commit protocol: objects, then ``manifest.json`` (every file's size and sha256, step, world size,
config hash), then ``latest``. A reader trusts a checkpoint only when its manifest is present and
every object matches it, and otherwise falls back to the next older verified one, saying so.

S3 goes through boto3: endpoint, region and credentials come from the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``...), never from arguments,
so they never reach a command line, a log or MLflow. Large files use boto3's transfer manager
(multipart, parallel parts); botocore retries throttling and dropped connections with backoff.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from training.config import ConfigError, check_path_part

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
MANIFEST_VERSION = 1


class StoreError(RuntimeError):
    """A store problem a user can act on; the message says what to do."""


class CheckpointCorrupt(StoreError):
    pass


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- backends


class FileStore:
    """A local folder laid out exactly like the bucket. Writes are tmp + fsync + rename."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        return self.root / key

    def put_file(self, local: str | Path, key: str, sha256: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        shutil.copyfile(local, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def put_bytes(self, data: bytes, key: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def get_file(self, key: str, local: str | Path) -> None:
        shutil.copyfile(self._path(key), local)

    def stat(self, key: str) -> dict[str, Any] | None:
        p = self._path(key)
        return {"size": p.stat().st_size} if p.is_file() else None

    def sha256(self, key: str) -> str | None:
        p = self._path(key)
        return sha256_file(p) if p.is_file() else None

    def list_dirs(self, prefix: str) -> list[str]:
        p = self._path(prefix)
        return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []


class S3Store:
    """An S3 bucket (AWS, MinIO, any S3 API) through boto3."""

    def __init__(self, bucket: str, prefix: str):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = boto3.client(
            "s3",
            region_name=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
            config=Config(retries={"max_attempts": 8, "mode": "standard"}, connect_timeout=5, read_timeout=60),
        )
        # 16 MiB parts, 8 in flight: large shards go up as parallel multipart uploads.
        self.transfer = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20,
                                       max_concurrency=8, use_threads=True)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn, *args, **kwargs):
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        try:
            return fn(*args, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchBucket",):
                raise StoreError(f"bucket '{self.bucket}' does not exist ({what}); create it or fix store_uri") from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreError(f"access denied to s3://{self.bucket} ({what}); check the S3 credentials "
                                 "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the Airflow connection)") from None
            raise
        except EndpointConnectionError as e:
            raise StoreError(f"S3 endpoint unreachable after retries ({what}): {e.kwargs.get('endpoint_url')}; "
                             "check AWS_ENDPOINT_URL and that the server is up") from None
        except NoCredentialsError:
            raise StoreError("no S3 credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                             "or configure the Airflow connection") from None

    def put_file(self, local: str | Path, key: str, sha256: str) -> None:
        self._call(f"upload {key}", self.client.upload_file, str(local), self.bucket, self._key(key),
                   ExtraArgs={"Metadata": {"sha256": sha256}}, Config=self.transfer)

    def put_bytes(self, data: bytes, key: str) -> None:
        self._call(f"put {key}", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   Metadata={"sha256": hashlib.sha256(data).hexdigest()})

    def get_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            obj = self._call(f"get {key}", self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return obj["Body"].read()

    def get_file(self, key: str, local: str | Path) -> None:
        self._call(f"download {key}", self.client.download_file, self.bucket, self._key(key), str(local),
                   Config=self.transfer)

    def stat(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            head = self._call(f"head {key}", self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return {"size": head["ContentLength"], "sha256": head.get("Metadata", {}).get("sha256")}

    def sha256(self, key: str) -> str | None:
        st = self.stat(key)
        return st.get("sha256") if st else None

    def list_dirs(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/") + "/"), Delimiter="/")
        out = []
        for page in self._call(f"list {prefix}", lambda: list(pages)):
            out += [cp["Prefix"].rstrip("/").rsplit("/", 1)[-1] for cp in page.get("CommonPrefixes", [])]
        return sorted(out)


def open_store(uri: str) -> FileStore | S3Store:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError("store_uri", f"{uri!r} names no bucket", "write s3://BUCKET/optional/prefix")
        for part in filter(None, parsed.path.split("/")):
            check_path_part("store_uri", part)
        return S3Store(parsed.netloc, parsed.path)
    if parsed.scheme == "" and uri:
        return FileStore(uri)
    raise ConfigError("store_uri", f"scheme {parsed.scheme!r} of {uri!r} is not supported",
                      "use file:///absolute/folder or s3://bucket/prefix")


# --------------------------------------------------------------------------- checkpoints


@dataclass
class Committed:
    uri: str
    step_dir: str
    manifest: dict[str, Any]
    uploaded: int
    skipped: int
    seconds: float


def run_prefix(experiment: str, run_id: str) -> str:
    return f"{check_path_part('experiment', experiment)}/{check_path_part('mlflow_run_id', run_id)}"


def build_manifest(local_dir: Path, *, step: int, world_size: int, config_hash: str) -> dict[str, Any]:
    files = []
    for p in sorted(local_dir.rglob("*")):
        if p.is_file() and not p.name.endswith((".tmp", ".partial")) and p.name != MANIFEST:
            files.append({"path": p.relative_to(local_dir).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)})
    return {"version": MANIFEST_VERSION, "step": step, "world_size": world_size, "config_hash": config_hash,
            "files": files, "created_unix": time.time()}


def upload_checkpoint(local_dir: str | Path, store_uri: str, *, experiment: str, run_id: str) -> Committed:
    """Commit one complete local checkpoint folder to the store; safe to re-run (task retries)."""
    t0 = time.perf_counter()
    local_dir = Path(local_dir)
    marker = local_dir / "COMPLETE"
    if not marker.is_file():
        raise StoreError(f"{local_dir} has no COMPLETE marker: the save was interrupted; refusing to upload it")
    info = json.loads(marker.read_text())
    store = open_store(store_uri)
    base = f"{run_prefix(experiment, run_id)}/{local_dir.name}"
    manifest = build_manifest(local_dir, step=info["step"], world_size=info["world_size"], config_hash=info["config_hash"])

    existing = store.get_bytes(f"{base}/{MANIFEST}")
    if existing is not None:
        old = json.loads(existing)
        if _file_set(old) != _file_set(manifest):
            raise StoreError(f"{store.uri}/{base} is already committed with different content; "
                             "a committed checkpoint is never overwritten (start a new MLflow run instead)")
        manifest = old
    uploaded = skipped = 0
    for f in manifest["files"]:
        key = f"{base}/{f['path']}"
        st = store.stat(key)
        if st and st["size"] == f["size"] and store.sha256(key) == f["sha256"]:
            skipped += 1
            continue
        store.put_file(local_dir / f["path"], key, f["sha256"])
        uploaded += 1
    if existing is None:
        store.put_bytes(json.dumps(manifest, indent=2).encode(), f"{base}/{MANIFEST}")
    pointer = {"step_dir": local_dir.name, "step": manifest["step"],
               "manifest_sha256": hashlib.sha256(json.dumps(manifest, indent=2).encode()).hexdigest()}
    store.put_bytes(json.dumps(pointer).encode(), f"{run_prefix(experiment, run_id)}/{LATEST}")
    return Committed(uri=f"{store.uri}/{base}", step_dir=local_dir.name, manifest=manifest,
                     uploaded=uploaded, skipped=skipped, seconds=time.perf_counter() - t0)


def _file_set(manifest: dict[str, Any]) -> set[tuple[str, int, str]]:
    return {(f["path"], f["size"], f["sha256"]) for f in manifest["files"]}


def _candidates(store, prefix: str) -> Iterator[str]:
    raw = store.get_bytes(f"{prefix}/{LATEST}")
    latest = json.loads(raw)["step_dir"] if raw else None
    if latest:
        yield latest
    for d in sorted(store.list_dirs(prefix), reverse=True):
        if d != latest and d.startswith("step_"):
            yield d


def fetch_checkpoint(store_uri: str, *, experiment: str, run_id: str, dest: str | Path) -> tuple[Path, dict[str, Any], list[str]]:
    """Download the newest verified checkpoint of a run into ``dest``.

    Returns (local folder, manifest, warnings). Every file's size and sha256 is checked against
    the manifest; a checkpoint that fails is skipped with a warning and the next older one tried.
    """
    store = open_store(store_uri)
    prefix = run_prefix(experiment, run_id)
    warnings: list[str] = []
    for step_dir in _candidates(store, prefix):
        raw = store.get_bytes(f"{prefix}/{step_dir}/{MANIFEST}")
        if raw is None:
            warnings.append(f"{step_dir}: no manifest (incomplete upload), ignored")
            continue
        manifest = json.loads(raw)
        local = Path(dest) / step_dir
        local.mkdir(parents=True, exist_ok=True)
        try:
            for f in manifest["files"]:
                target = local / f["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                store.get_file(f"{prefix}/{step_dir}/{f['path']}", target)
                if target.stat().st_size != f["size"] or sha256_file(target) != f["sha256"]:
                    raise CheckpointCorrupt(f"{step_dir}/{f['path']} does not match its manifest sha256")
        except (CheckpointCorrupt, OSError) as e:
            warnings.append(f"{step_dir}: {e}; falling back to an older checkpoint")
            shutil.rmtree(local, ignore_errors=True)
            continue
        for w in warnings:
            log.warning(w)
        return local, manifest, warnings
    raise StoreError(f"no verified checkpoint under {store.uri}/{prefix} ({'; '.join(warnings) or 'nothing uploaded'})")
