"""The ``s3://`` store: an S3 bucket (AWS, MinIO, any S3 API) through boto3, with the same
interface as the folder store (store/file.py).

Endpoint, region and credentials come from the standard AWS environment (``AWS_ENDPOINT_URL``,
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``...) or from a mapping the caller hands to the store
object (the Airflow side, from a connection), never from arguments, so they never reach a command
line, a log or MLflow. Files and streams go through boto3's transfer manager (multipart, parallel
parts); botocore retries throttling, 5xx and dropped connections with exponential backoff; errors
are mapped to ``StoreError`` messages a person can act on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

from training.store.base import ObjectMissing, StoreError

PROBE = ".write-check"  # the object check_access writes (and leaves) at a location


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


class _Pipe:
    """Bytes written by one thread (DCP serializing a shard) and read by another (boto3's
    transfer manager, uploading them in parts as they come), at most ``depth`` writes in between.
    A writer that fails makes the reader fail, so the transfer manager aborts the multipart upload
    rather than complete a truncated object; an upload that fails makes the writer fail."""

    _EOF = object()

    def __init__(self, depth: int = 2) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.rest = memoryview(b"")
        self.failed: BaseException | None = None  # set by the reading side

    def write(self, data) -> int:
        item = bytes(data)
        while True:
            if self.failed is not None:
                raise self.failed
            try:
                self.q.put(item, timeout=0.2)
                return len(item)
            except queue.Full:
                continue

    def end(self, error: BaseException | None = None) -> None:
        """No more writes: the end of the object, or ``error``, which the reader raises."""
        while self.failed is None:
            try:
                self.q.put(error if error is not None else self._EOF, timeout=0.2)
                return
            except queue.Full:
                continue

    def read(self, n: int = -1) -> bytes:
        parts, have = [], 0
        while n < 0 or have < n:
            if not self.rest:
                item = self.q.get()
                if item is self._EOF or isinstance(item, BaseException):
                    self.q.put(item)  # every later read sees it too
                    if isinstance(item, BaseException):
                        raise item
                    break
                self.rest = memoryview(item)
            take = len(self.rest) if n < 0 else min(len(self.rest), n - have)
            parts.append(self.rest[:take])
            self.rest, have = self.rest[take:], have + take
        return b"".join(parts)  # the one copy of the bytes on the way to the request

    def readable(self) -> bool:
        return True


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

    def __init__(self, bucket: str, prefix: str, env: Mapping[str, str] | None = None, field: str = "store_uri"):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        cfg = {k: v for k, v in {**os.environ, **(env or {})}.items() if k in S3_ENV_KEYS and v}
        self.bucket, self.prefix, self.field = bucket, prefix.strip("/"), field
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
        self.transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency,
                                       use_threads=True)
        # A stream (open_write) is read into memory part by part: at most ``concurrency`` parts held
        # (s3transfer's setting; boto3's constructor does not take it).
        self.transfer.max_in_memory_upload_chunks = concurrency

    def _key(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, key.strip("/")) if p)

    def _folder(self, prefix: str) -> str:
        """The listing prefix of a folder: its key and a ``/`` (nothing for the bucket's root)."""
        key = self._key(prefix)
        return f"{key}/" if key else ""

    def _error(self, what: str, exc: BaseException) -> Exception | None:
        """Map a boto error to a StoreError a person can act on; None if it is not one we know.

        Messages name the bucket, the endpoint and the operation, never a credential."""
        from botocore import exceptions as boto
        from urllib3.exceptions import ProtocolError

        where = f"s3://{self.bucket}" + (f" at {self.endpoint}" if self.endpoint else "")
        for e in _root_causes(exc):
            if isinstance(e, boto.ClientError):
                code = str(e.response.get("Error", {}).get("Code", ""))
                if code == "NoSuchBucket":
                    return StoreError(f"bucket '{self.bucket}' does not exist ({what}); create it or fix {self.field}",
                                      bad_input=True)
                if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                            "InvalidToken", "AllAccessDisabled"):
                    return StoreError(f"access denied to {where} ({what}: {code}); check the S3 credentials "
                                      "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the Airflow connection aws_conn_id) "
                                      "and the bucket policy", bad_input=True)
            if isinstance(e, (boto.NoCredentialsError, boto.PartialCredentialsError)):
                return StoreError("no S3 credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY on the worker "
                                  "or name an Airflow connection in aws_conn_id", bad_input=True)
            if isinstance(e, (boto.EndpointConnectionError, boto.ConnectTimeoutError)):
                return StoreError(f"S3 endpoint unreachable after {self.attempts} attempts ({what}): "
                                  f"{self.endpoint or 'the AWS default endpoint'}; check AWS_ENDPOINT_URL (or the "
                                  "connection's endpoint_url) and that the server is up")
            if isinstance(e, (boto.ConnectionClosedError, boto.ReadTimeoutError, boto.ResponseStreamingError,
                              boto.IncompleteReadError, boto.ConnectionError, ProtocolError, ConnectionError)):
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
        from botocore.exceptions import ClientError

        return isinstance(e, ClientError) and str(e.response.get("Error", {}).get("Code")) in ("NoSuchKey", "404", "NotFound")

    def put_file(self, local: str | Path, key: str, sha256: str) -> None:
        self._call(f"upload {key}", self.client.upload_file, str(local), self.bucket, self._key(key),
                   ExtraArgs={"Metadata": {"sha256": sha256}}, Config=self.transfer)

    def put_bytes(self, data: bytes, key: str) -> None:
        self._call(f"put {key}", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   Metadata={"sha256": hashlib.sha256(data).hexdigest()})

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[IO[bytes]]:
        """A stream uploaded while it is written: boto3's transfer manager reads it in parts of
        the multipart size and uploads them in parallel (a single PUT if it stays smaller), so
        nothing is spooled to disk. The object exists only once complete; a failure on either
        side aborts the upload. (The object carries no sha256 metadata: it is unknown until the
        end; the manifest has it.)"""
        pipe, failure = _Pipe(), []

        def upload() -> None:
            try:
                self._call(f"upload {key}", self.client.upload_fileobj, pipe, self.bucket, self._key(key),
                           Config=self.transfer)
            except BaseException as e:  # handed to the writer, re-raised below
                failure.append(e)
                pipe.failed = e

        uploader = threading.Thread(target=upload, name=f"upload {key}", daemon=True)
        uploader.start()
        try:
            yield pipe  # type: ignore[misc]
        except BaseException as e:
            pipe.end(RuntimeError(f"writing {key} failed: {e}"))
            uploader.join()
            raise
        pipe.end()
        uploader.join()
        if failure:
            raise failure[0]

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
                raise ObjectMissing(f"{key} is missing from {self.uri}") from None
            raise self._error(f"download {key}", e) or e from None

    def local_path(self, key: str) -> Path | None:
        return None  # objects are downloaded to be read

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
                Bucket=self.bucket, Prefix=self._folder(prefix), Delimiter="/")
            return [cp["Prefix"].rstrip("/").rsplit("/", 1)[-1] for page in pages for cp in page.get("CommonPrefixes", [])]

        return sorted(self._call(f"list {prefix}", run))

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (relative to the store's prefix)."""
        def run() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._folder(prefix))
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

    def check_access(self, prefix: str) -> None:
        """List and write under ``prefix`` once, so that a missing bucket, wrong keys or a policy
        that denies either fail here, naming the operation, before anything is computed."""
        key = f"{prefix}/{PROBE}" if prefix else PROBE
        self._call(f"list {self._folder(prefix) or '/'}", self.client.list_objects_v2, Bucket=self.bucket,
                   Prefix=self._folder(prefix), MaxKeys=1)
        self._call(f"put {self._key(key)}", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=b"")
