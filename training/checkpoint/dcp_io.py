"""DCP's storage layer on our stores: ``StoreWriter`` and ``VerifiedReader`` are DCP's own
FileSystemWriter and FileSystemReader (DCP's format, nothing of ours) on a store (store/base.py).

- ``StoreWriter`` streams every file DCP writes straight into the store, hashing it on the way,
  and commits with the protocol of training/checkpoint/commit.py: the digests ride DCP's own gather
  of write results (``DIGESTS``), then the caller's ``on_commit`` writes the manifest and ``latest``.
- ``VerifiedReader`` lets a rank read only files whose size and sha256 match the manifest, checked
  before a byte reaches the model (``CheckpointCorrupt`` otherwise, on every rank).

Why not DCP's fsspec writer through s3fs: docs/decisions/0001-dcp-on-our-own-store.md.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from training.checkpoint.commit import MANIFEST, CheckpointCorrupt, Location, file_entry, verified_file

METADATA = ".metadata"  # DCP's file name (filesystem._metadata_fn)
DIGESTS = "__manifest_entry__/"  # MetadataIndex fqn prefix of a file's manifest entry in the write results


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _is_digest(result: WriteResult) -> bool:
    return result.index.fqn.startswith(DIGESTS)


class _HashingStream:
    """A file DCP writes front to back, hashed on the way: nobody reads a shard back to hash it."""

    def __init__(self, f) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.f.write(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:  # DCP records each item's offset; an upload stream cannot tell
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:  # DCP closes the stream; the store finishes the file when the context ends
        pass


class _StoreFileSystem(FileSystem):
    """DCP's file system calls, answered by a store: each file DCP writes goes straight into the
    store (``Store.open_write``: a folder store's file, or an S3 upload while it is written) and
    its size and sha256 are kept (by name). Every store write is atomic, so DCP's temporary
    ``.metadata.tmp`` is written under its final name and the rename is nothing."""

    def __init__(self, loc: Location, step_dir: str) -> None:
        self.loc, self.step_dir = loc, step_dir
        self.written: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            raise ValueError(f"{type(self).__name__} only writes")
        name = Path(path).name.removesuffix(".tmp")
        with self.loc.store.open_write(self.loc.key(self.step_dir, name)) as f:
            stream = _HashingStream(f)
            yield stream
        self.written[name] = {"path": name, "size": stream.size, "sha256": stream.sha256.hexdigest()}

    def rename(self, path, new_path) -> None:
        pass

    def mkdir(self, path) -> None:
        pass

    def exists(self, path) -> bool:
        return False

    def rm_file(self, path) -> None:
        pass


class StoreWriter(FileSystemWriter):
    """Writes one checkpoint (``step_dir``) of ``loc`` with DCP's FileSystemWriter, every file
    straight into the store. ``extras``: further files of this rank, bytes to write or a local
    file to copy in (the exported model); ``on_commit(files)``: called on the coordinator with
    every file's manifest entry once every rank stored its files and ``.metadata`` is stored; it
    writes the manifest and ``latest``. ``replaces``: the step folder may hold an older commit,
    whose manifest goes first."""

    def __init__(self, loc: Location, step_dir: str, *, extras: dict[str, bytes | Path],
                 on_commit: Callable[[list[dict[str, Any]]], None], replaces: bool = False) -> None:
        # No fsync by DCP: the store makes each file durable before it names it (open_write).
        super().__init__(step_dir, sync_files=False, overwrite=True)
        self.fs = _StoreFileSystem(loc, step_dir)
        self.loc, self.step_dir, self.extras, self.on_commit, self.replaces = loc, step_dir, extras, on_commit, replaces

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # nothing to create; overwriting is decided by ``replaces``

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.replaces:  # before any rank writes: the old manifest must never vouch for new bytes
            self.loc.store.delete([self.loc.key(self.step_dir, MANIFEST)])
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).value()
        for name, data in self.extras.items():
            if isinstance(data, bytes):
                with self.fs.create_stream(name, "wb") as f:
                    f.write(data)
            else:  # a file written by other code (the exported model): hashed, then copied in
                entry = file_entry(name, data)
                self.loc.store.put_file(data, self.loc.key(self.step_dir, name), entry["sha256"])
                self.fs.written[name] = entry
        done: Future[list[WriteResult]] = Future()
        done.set_result(results + [WriteResult(index=MetadataIndex(DIGESTS + e["path"]), size_in_bytes=e["size"],
                                               storage_data=e) for e in self.fs.written.values()])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        entries = [r.storage_data for rs in results for r in rs if _is_digest(r)]
        super().finish(metadata, [[r for r in rs if not _is_digest(r)] for rs in results])
        self.on_commit([*entries, self.fs.written[METADATA]])


class VerifiedReader(FileSystemReader):
    """Reads checkpoint ``step_dir`` of ``loc`` whose manifest is ``manifest``. Every file this rank
    reads (``.metadata``, the shards its load plan names, its RNG file) is verified once, in
    ``prepare_local_plan``: a mismatch there fails DCP's planning step on every rank (DCP gathers
    the failures), before anything is copied into the model. ``cache``: where S3 objects are
    downloaded to (a folder store is read in place)."""

    def __init__(self, loc: Location, step_dir: str, manifest: dict[str, Any], cache: Path) -> None:
        local = loc.store.local_path(loc.key(step_dir))
        super().__init__(local if local is not None else cache)
        self.loc, self.step_dir, self.cache = loc, step_dir, cache
        self.entries = {f["path"]: f for f in manifest["files"]}
        self.verified: dict[str, Path] = {}

    def fetch(self, name: str) -> Path:
        """This file, verified against the manifest (once)."""
        if name not in self.verified:
            if name not in self.entries:
                raise CheckpointCorrupt(f"{self.step_dir}/{name} is not in its manifest")
            self.verified[name] = verified_file(self.loc, self.step_dir, self.entries[name], self.cache)
        return self.verified[name]

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never tries per-rank metadata files
        self.fetch(METADATA)
        return super().read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self.fetch(name)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rng_file(rank) in self.entries:
            self.fetch(rng_file(rank))
        return super().prepare_local_plan(plan)


# --------------------------------------------------------------------------- DCP's failures, readable


def failures(e: CheckpointException) -> dict[int, BaseException]:
    """DCP's gathered failures: rank -> its exception."""
    return {rank: exc for rank, (exc, _trace) in e.failures.items()}


def describe(by_rank: dict[int, BaseException]) -> str:
    return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, exc in sorted(by_rank.items()))


def not_committed(uri: str, e: CheckpointException) -> RuntimeError:
    return RuntimeError(f"checkpoint {uri} was not committed (`latest` stays on the previous one): "
                        f"{describe(failures(e))}")
