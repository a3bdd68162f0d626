"""Checkpoint store: ``file://`` folders and ``s3://`` buckets with the same layout and rules.

Layout::

    {store}/{experiment}/{mlflow_run_id}/step_{step:08d}/<files>
    {store}/{experiment}/{mlflow_run_id}/step_{step:08d}/manifest.json   written after every file
    {store}/{experiment}/{mlflow_run_id}/step_{step:08d}/eval.json       evaluation (not in the manifest)
    {store}/{experiment}/{mlflow_run_id}/latest                          written after the manifest

Commit protocol: objects, then ``manifest.json`` (every file's size and sha256, step, world size,
config hash), then ``latest`` (step folder + the manifest's sha256). A reader trusts a checkpoint
only when its manifest is present (and is the one ``latest`` recorded) and every object matches
it, and otherwise falls back to the next older verified one, saying so. Retention keeps the last K,
the best by evaluation and whatever ``latest`` names.

S3 goes through boto3: endpoint, region and credentials come from the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``...) or from a mapping the
caller hands to the store object (the Airflow side, from a connection), never from arguments, so
they never reach a command line, a log or MLflow. Large files use boto3's transfer manager
(multipart, parallel parts); botocore retries throttling, 5xx and dropped connections with
exponential backoff.
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
from typing import Any, Iterator, Mapping
from urllib.parse import urlparse

from training.config import ConfigError, check_path_part
from training.util import atomic_write, sha256_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
MANIFEST_VERSION = 1


class StoreError(RuntimeError):
    """A store problem a user can act on; the message says what to do."""


class CheckpointCorrupt(StoreError):
    pass


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
        atomic_write(self._path(key), data, tmp_suffix=".partial")

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def get_file(self, key: str, local: str | Path) -> None:
        try:
            shutil.copyfile(self._path(key), local)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{key} is missing from {self.uri}") from None

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


# The settings an S3 store reads. A caller (the Airflow task, reading an Airflow connection) may
# hand them over as a mapping that overrides the process environment for one store object; they
# are never arguments on a command line, never logged, never written anywhere.
S3_ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ACCESS_KEY_ID",
               "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
               "TRAINING_S3_CONNECT_TIMEOUT_S", "TRAINING_S3_READ_TIMEOUT_S", "TRAINING_S3_PART_SIZE_MB",
               "TRAINING_S3_CONCURRENCY")

# Multipart settings for checkpoint shards (tens of MB to GBs each). boto3's defaults are 8 MiB
# parts and 10 threads. 16 MiB halves the requests (signatures, checksums, round trips) per shard,
# allows objects up to 160 GB within S3's 10,000-part limit, and still keeps 8 parts in flight for
# any shard of 128 MiB or more. benchmarks/upload_bench.py measures it against the defaults.
PART_SIZE = 16 << 20
CONCURRENCY = 8


def _is(exc: BaseException, *names: str) -> bool:
    return any(type(exc).__name__ == n or any(b.__name__ == n for b in type(exc).__mro__) for n in names)


def _root_causes(exc: BaseException) -> list[BaseException]:
    """boto3 wraps some errors (S3UploadFailedError around the ClientError): look at the whole chain."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


class S3Store:
    """An S3 bucket (AWS, MinIO, any S3 API) through boto3.

    Settings (``env`` overrides the process environment, key by key): ``AWS_ENDPOINT_URL`` (or
    ``AWS_ENDPOINT_URL_S3``), ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
    / ``AWS_SESSION_TOKEN`` (else boto3's own chain: profile, container or instance role),
    ``AWS_MAX_ATTEMPTS`` (total attempts per request, default 8) and ``AWS_RETRY_MODE`` (default
    ``standard``: exponential backoff with jitter on throttling, 5xx and dropped connections),
    ``TRAINING_S3_CONNECT_TIMEOUT_S`` (default 5), ``TRAINING_S3_READ_TIMEOUT_S`` (default 60),
    ``TRAINING_S3_PART_SIZE_MB`` (multipart part size, default 16) and ``TRAINING_S3_CONCURRENCY``
    (parts in flight, default 8).
    """

    def __init__(self, bucket: str, prefix: str, env: Mapping[str, str] | None = None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        cfg = {k: v for k, v in {**os.environ, **(env or {})}.items() if k in S3_ENV_KEYS and v}
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint = cfg.get("AWS_ENDPOINT_URL_S3") or cfg.get("AWS_ENDPOINT_URL")
        self.attempts = int(cfg.get("AWS_MAX_ATTEMPTS", 8))
        part = int(float(cfg.get("TRAINING_S3_PART_SIZE_MB", PART_SIZE >> 20)) * (1 << 20))
        concurrency = int(cfg.get("TRAINING_S3_CONCURRENCY", CONCURRENCY))
        kwargs: dict[str, Any] = {}
        if "AWS_ACCESS_KEY_ID" in cfg and "AWS_SECRET_ACCESS_KEY" in cfg:
            kwargs.update(aws_access_key_id=cfg["AWS_ACCESS_KEY_ID"], aws_secret_access_key=cfg["AWS_SECRET_ACCESS_KEY"],
                          aws_session_token=cfg.get("AWS_SESSION_TOKEN"))
        # boto3's default session: its loaded service models are reused by every store object.
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint,
            region_name=cfg.get("AWS_DEFAULT_REGION") or cfg.get("AWS_REGION") or "us-east-1",
            config=Config(retries={"total_max_attempts": self.attempts, "mode": cfg.get("AWS_RETRY_MODE", "standard")},
                          connect_timeout=float(cfg.get("TRAINING_S3_CONNECT_TIMEOUT_S", 5)),
                          read_timeout=float(cfg.get("TRAINING_S3_READ_TIMEOUT_S", 60)),
                          max_pool_connections=max(10, concurrency + 2)),
            **kwargs)
        self.transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                       max_concurrency=concurrency, use_threads=True)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, what: str, exc: BaseException) -> Exception | None:
        """Map a boto error to a StoreError a person can act on; None if it is not one we know.

        Messages name the bucket, the endpoint and the operation, never a credential."""
        where = f"s3://{self.bucket}" + (f" at {self.endpoint}" if self.endpoint else "")
        for e in _root_causes(exc):
            if _is(e, "ClientError"):
                code = str(e.response.get("Error", {}).get("Code", ""))
                if code == "NoSuchBucket":
                    return StoreError(f"bucket '{self.bucket}' does not exist ({what}); create it or fix store_uri")
                if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                            "InvalidToken", "AllAccessDisabled"):
                    return StoreError(f"access denied to {where} ({what}: {code}); check the S3 credentials "
                                      "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the Airflow connection aws_conn_id) "
                                      "and the bucket policy")
            if _is(e, "NoCredentialsError", "PartialCredentialsError"):
                return StoreError("no S3 credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY on the worker "
                                  "or name an Airflow connection in aws_conn_id")
            if _is(e, "EndpointConnectionError", "ConnectTimeoutError"):
                return StoreError(f"S3 endpoint unreachable after {self.attempts} attempts ({what}): "
                                  f"{self.endpoint or 'the AWS default endpoint'}; check AWS_ENDPOINT_URL (or the "
                                  "connection's endpoint_url) and that the server is up")
            if _is(e, "ConnectionClosedError", "ReadTimeoutError", "ResponseStreamingError", "ProtocolError",
                   "IncompleteReadError", "ConnectionError"):
                return StoreError(f"connection to {where} lost after {self.attempts} attempts ({what}): "
                                  f"{type(e).__name__}; nothing was committed, a retry skips what is already stored")
        return None

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StoreError:
            raise
        except Exception as e:
            mapped = self._error(what, e)
            if mapped is None:
                raise
            raise mapped from None

    @staticmethod
    def _missing(e: BaseException) -> bool:
        return _is(e, "ClientError") and str(e.response.get("Error", {}).get("Code")) in ("NoSuchKey", "404", "NotFound")

    def put_file(self, local: str | Path, key: str, sha256: str) -> None:
        self._call(f"upload {key}", self.client.upload_file, str(local), self.bucket, self._key(key),
                   ExtraArgs={"Metadata": {"sha256": sha256}}, Config=self.transfer)

    def put_bytes(self, data: bytes, key: str) -> None:
        self._call(f"put {key}", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   Metadata={"sha256": hashlib.sha256(data).hexdigest()})

    def get_bytes(self, key: str) -> bytes | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return obj["Body"].read()
        except Exception as e:
            if self._missing(e):
                return None
            raise self._error(f"get {key}", e) or e from None

    def get_file(self, key: str, local: str | Path) -> None:
        try:
            self.client.download_file(self.bucket, self._key(key), str(local), Config=self.transfer)
        except Exception as e:
            if self._missing(e):
                raise CheckpointCorrupt(f"{key} is missing from {self.uri}") from None
            raise self._error(f"download {key}", e) or e from None

    def stat(self, key: str) -> dict[str, Any] | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            if self._missing(e):
                return None
            raise self._error(f"head {key}", e) or e from None
        return {"size": head["ContentLength"], "sha256": head.get("Metadata", {}).get("sha256")}

    def sha256(self, key: str) -> str | None:
        st = self.stat(key)
        return st.get("sha256") if st else None

    def list_dirs(self, prefix: str) -> list[str]:
        def run() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/") + "/"), Delimiter="/")
            return [cp["Prefix"].rstrip("/").rsplit("/", 1)[-1] for page in pages for cp in page.get("CommonPrefixes", [])]

        return sorted(self._call(f"list {prefix}", run))

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (relative to the store's prefix)."""
        def run() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/") + "/"))
            cut = len(self.prefix) + 1 if self.prefix else 0
            return [o["Key"][cut:] for page in pages for o in page.get("Contents", [])]

        return self._call(f"list {prefix}", run)

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            out = self._call(f"delete {len(batch)} objects", self.client.delete_objects, Bucket=self.bucket,
                             Delete={"Objects": batch, "Quiet": True})
            if out.get("Errors"):
                e = out["Errors"][0]
                raise StoreError(f"could not delete {e.get('Key')} from s3://{self.bucket}: {e.get('Code')}")


def open_store(uri: str, env: Mapping[str, str] | None = None) -> FileStore | S3Store:
    """The store behind ``uri``. ``env``: S3 settings that override the process environment."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError("store_uri", f"{uri!r} names no bucket", "write s3://BUCKET/optional/prefix")
        for part in filter(None, parsed.path.split("/")):
            check_path_part("store_uri", part)
        return S3Store(parsed.netloc, parsed.path, env)
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


def upload_checkpoint(local_dir: str | Path, store_uri: str, *, experiment: str, run_id: str,
                      env: Mapping[str, str] | None = None) -> Committed:
    """Commit one complete local checkpoint folder to the store; safe to re-run (task retries).

    Objects first, then ``manifest.json``, then ``latest``; each write returns only once stored, so
    a failure anywhere leaves ``latest`` on the previous checkpoint. ``env``: S3 settings (see S3Store).
    """
    t0 = time.perf_counter()
    local_dir = Path(local_dir)
    marker = local_dir / "COMPLETE"
    if not marker.is_file():
        raise StoreError(f"{local_dir} has no COMPLETE marker: the save was interrupted; refusing to upload it")
    info = json.loads(marker.read_text())
    store = open_store(store_uri, env)
    prefix = run_prefix(experiment, run_id)
    base = f"{prefix}/{check_path_part('checkpoint folder', local_dir.name)}"
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
    manifest_bytes = existing if existing is not None else json.dumps(manifest, indent=2).encode()
    if existing is None:
        store.put_bytes(manifest_bytes, f"{base}/{MANIFEST}")
    current = _read_pointer(store, prefix)
    if current and current.get("step", -1) > manifest["step"] and current.get("step_dir") != local_dir.name:
        # An older checkpoint re-uploaded (a late retry) never moves `latest` backwards.
        log.warning("%s committed, but `latest` stays on the newer %s", base, current["step_dir"])
    else:
        pointer = {"step_dir": local_dir.name, "step": manifest["step"],
                   "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
        store.put_bytes(json.dumps(pointer).encode(), f"{prefix}/{LATEST}")
    return Committed(uri=f"{store.uri}/{base}", step_dir=local_dir.name, manifest=manifest,
                     uploaded=uploaded, skipped=skipped, seconds=time.perf_counter() - t0)


def _file_set(manifest: dict[str, Any]) -> set[tuple[str, int, str]]:
    return {(f["path"], f["size"], f["sha256"]) for f in manifest["files"]}


def _read_pointer(store, prefix: str) -> dict[str, Any] | None:
    raw = store.get_bytes(f"{prefix}/{LATEST}")
    if raw is None:
        return None
    try:
        pointer = json.loads(raw)
        return pointer if isinstance(pointer, dict) and isinstance(pointer.get("step_dir"), str) else None
    except ValueError:
        return None


def _candidates(store, prefix: str, pointer: dict[str, Any] | None) -> Iterator[str]:
    latest = pointer["step_dir"] if pointer else None
    if latest:
        yield latest
    for d in sorted(store.list_dirs(prefix), reverse=True):
        if d != latest and d.startswith("step_"):
            yield d


def fetch_checkpoint(store_uri: str, *, experiment: str, run_id: str, dest: str | Path,
                     env: Mapping[str, str] | None = None, step_dir: str | None = None,
                     only: tuple[str, ...] | None = None) -> tuple[Path, dict[str, Any], list[str]]:
    """Download the newest verified checkpoint of a run into ``dest``.

    Returns (local folder, manifest, warnings). Every file's size and sha256 is checked against
    the manifest; a checkpoint without a manifest, with a missing, truncated or altered object, or
    whose manifest is not the one ``latest`` committed, is skipped with a warning (logged, and
    returned for the caller to record) and the next older one is tried. ``step_dir``: that
    checkpoint only (no fallback); ``only``: download and verify just these files of it.
    """
    store = open_store(store_uri, env)
    prefix = run_prefix(experiment, run_id)
    warnings: list[str] = []
    pointer = _read_pointer(store, prefix)
    if pointer is None and store.get_bytes(f"{prefix}/{LATEST}") is not None:
        warnings.append("`latest` is unreadable, ignored; trying every checkpoint, newest first")
    candidates = [check_path_part("step_dir", step_dir)] if step_dir else _candidates(store, prefix, pointer)
    for step_dir in candidates:
        raw = store.get_bytes(f"{prefix}/{step_dir}/{MANIFEST}")
        if raw is None:
            warnings.append(f"{step_dir}: no manifest (incomplete upload), ignored")
            continue
        try:
            manifest = json.loads(raw)
            files = manifest["files"]
        except (ValueError, KeyError, TypeError):
            warnings.append(f"{step_dir}: manifest unreadable, ignored")
            continue
        if pointer and step_dir == pointer["step_dir"] and pointer.get("manifest_sha256") not in (
                None, hashlib.sha256(raw).hexdigest()):
            warnings.append(f"{step_dir}: manifest differs from the one `latest` committed; falling back to an older checkpoint")
            continue
        local = Path(dest) / step_dir
        local.mkdir(parents=True, exist_ok=True)
        try:
            for f in files:
                if only is not None and f["path"] not in only:
                    continue
                target = local / f["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                store.get_file(f"{prefix}/{step_dir}/{f['path']}", target)
                if target.stat().st_size != f["size"]:
                    raise CheckpointCorrupt(f"{step_dir}/{f['path']} has {target.stat().st_size} bytes, "
                                            f"its manifest says {f['size']}")
                if sha256_file(target) != f["sha256"]:
                    raise CheckpointCorrupt(f"{step_dir}/{f['path']} does not match its manifest sha256")
        except (CheckpointCorrupt, OSError) as e:
            warnings.append(f"{e}; falling back to an older checkpoint" if str(e).startswith(step_dir)
                            else f"{step_dir}: {e}; falling back to an older checkpoint")
            shutil.rmtree(local, ignore_errors=True)
            continue
        for w in warnings:
            log.warning("checkpoint fallback: %s", w)
        return local, manifest, warnings
    raise StoreError(f"no verified checkpoint under {store.uri}/{prefix} ({'; '.join(warnings) or 'nothing uploaded'})")


# --------------------------------------------------------------------------- retention

EVAL_FILE = "eval.json"


def record_eval(store_uri: str, *, experiment: str, run_id: str, step_dir: str, metrics: dict[str, float],
                env: Mapping[str, str] | None = None) -> None:
    """Store a checkpoint's evaluation next to its manifest (not part of it), for retention's
    best-by-eval rule."""
    store = open_store(store_uri, env)
    key = f"{run_prefix(experiment, run_id)}/{check_path_part('step_dir', step_dir)}/{EVAL_FILE}"
    store.put_bytes(json.dumps({k: float(v) for k, v in metrics.items()}).encode(), key)


@dataclass
class Retention:
    kept: list[str]
    deleted: list[str]
    reasons: dict[str, str]


def apply_retention(store_uri: str, *, experiment: str, run_id: str, keep_last: int, metric: str = "eval/loss",
                    mode: str = "min", env: Mapping[str, str] | None = None) -> Retention:
    """Delete old checkpoints of a run, keeping the last ``keep_last`` committed ones, the best one
    by ``metric`` (from ``record_eval``), and always the one ``latest`` points to.

    ``keep_last=0`` keeps everything. Folders without a manifest older than the newest committed
    checkpoint are leftovers of failed uploads and go too; newer ones may be an upload in progress
    and stay. Each doomed checkpoint loses its manifest first, so a reader never trusts a half-deleted
    one. (Hand-written: S3 lifecycle rules expire by age, not by rank or score.)
    """
    if keep_last < 0:
        raise ConfigError("retention_keep_last", f"{keep_last} is negative", "use 0 (keep all) or a positive count")
    if mode not in ("min", "max"):
        raise ConfigError("retention mode", f"{mode!r} is not supported", "use 'min' or 'max'")
    store = open_store(store_uri, env)
    prefix = run_prefix(experiment, run_id)
    dirs = sorted(d for d in store.list_dirs(prefix) if d.startswith("step_"))
    committed = [d for d in dirs if store.stat(f"{prefix}/{d}/{MANIFEST}") is not None]
    if keep_last == 0:
        return Retention(kept=dirs, deleted=[], reasons={d: "keep_last=0 keeps all" for d in dirs})
    reasons: dict[str, str] = {}
    pointer = _read_pointer(store, prefix)
    if pointer and pointer["step_dir"] in dirs:
        reasons[pointer["step_dir"]] = "latest"
    for d in committed[-keep_last:]:
        reasons.setdefault(d, f"among the last {keep_last}")
    scored = []
    for d in committed:
        raw = store.get_bytes(f"{prefix}/{d}/{EVAL_FILE}")
        value = json.loads(raw).get(metric) if raw else None
        if isinstance(value, (int, float)) and value == value:
            scored.append((value if mode == "min" else -value, d))
    if scored:
        reasons.setdefault(min(scored)[1], f"best {metric}")
    newest = committed[-1] if committed else None
    for d in dirs:
        if d not in committed and newest is not None and d > newest:
            reasons.setdefault(d, "newer than every committed checkpoint (upload may be in progress)")
    doomed = [d for d in dirs if d not in reasons]
    for d in doomed:
        store.delete([f"{prefix}/{d}/{MANIFEST}"])  # untrusted from here on
        store.delete([k for k in store.list_keys(f"{prefix}/{d}")])
        log.info("retention: deleted %s/%s", prefix, d)
    return Retention(kept=[d for d in dirs if d in reasons], deleted=doomed, reasons=reasons)
