"""The commit protocol of checkpoints, the same for every checkpoint and every store (training/stores.py).

Layout of one run's checkpoints (``Location``: a store and a prefix; for the trainer the prefix is
empty and ``checkpoint_dir`` is the store, for the pipeline it is ``{experiment}/{mlflow_run_id}``
in ``store_uri``)::

    {location}/step_{step:08d}/<files>         DCP shards, .metadata, rng_rankN.pt (+ the model, final step)
    {location}/step_{step:08d}/manifest.json   written after every file: each file's size and sha256
    {location}/step_{step:08d}/eval.json       evaluation (not in the manifest), for retention
    {location}/latest                          written after the manifest: step folder + manifest sha256

Commit: objects, then ``manifest.json`` (every file's size and sha256, each computed by the rank
that wrote the file; step, world size, config hash), then ``latest``. Each write returns only once
stored, so a failure anywhere leaves ``latest`` on the previous checkpoint. A reader trusts a
checkpoint only when its manifest is present (and is the one ``latest`` recorded) and every object
it reads matches it, and otherwise falls back to the next older one, saying why (``candidates``,
``verified_file``). Retention keeps the last K, the best by evaluation and whatever ``latest``
names, and deletes a checkpoint's manifest before its objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping
from urllib.parse import urlparse

from training.config import ConfigError, check_path_part
from training.s3_store import S3Store
from training.stores import CheckpointCorrupt, FileStore, Store, StoreError
from training.util import sha256_file

__all__ = ["CheckpointCorrupt", "FileStore", "S3Store", "StoreError", "open_store", "sha256_file", "Location",
           "upload_checkpoint", "fetch_checkpoint", "apply_retention", "record_eval"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
EVAL_FILE = "eval.json"
MANIFEST_VERSION = 1


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


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class Location:
    """Where one run's checkpoints live: ``prefix`` inside ``store``."""

    store: Store
    prefix: str = ""

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def uri(self, *parts: str) -> str:
        return "/".join([self.store.uri.rstrip("/"), *(p for p in (self.prefix, *parts) if p)])


def run_prefix(experiment: str, run_id: str) -> str:
    return f"{check_path_part('experiment', experiment)}/{check_path_part('mlflow_run_id', run_id)}"


def run_location(store_uri: str, experiment: str, run_id: str, env: Mapping[str, str] | None = None) -> Location:
    """A pipeline run's checkpoints in ``store_uri``: prefix ``{experiment}/{mlflow_run_id}``."""
    return Location(open_store(store_uri, env), run_prefix(experiment, run_id))


def run_uri(store_uri: str, experiment: str, run_id: str) -> str:
    """The same place as one URI: the ``checkpoint_dir`` ranks write to when they commit to the store."""
    return f"{store_uri.rstrip('/')}/{run_prefix(experiment, run_id)}"


def check_writable(uri: str, env: Mapping[str, str] | None = None, *, field: str) -> Location:
    """List and write the location ``uri`` (config field ``field``) once, before anything is
    computed. A missing bucket, keys that are wrong or denied, an unwritable folder are bad input:
    ConfigError naming the field, the bucket (or folder) and the operation, never a credential. An
    unreachable endpoint is an outage a retry may outlive: StoreError."""
    loc = Location(open_store(uri, env, field=field))
    try:
        loc.store.check_access(loc.prefix)
    except StoreError as e:
        if not e.bad_input:
            raise
        raise ConfigError(field, str(e), "nothing was started; fix the location or its access, then run again") from None
    return loc


# --------------------------------------------------------------------------- writing


def file_entry(name: str, local: Path) -> dict[str, Any]:
    """A manifest entry: computed by the process that wrote ``local``."""
    return {"path": name, "size": local.stat().st_size, "sha256": sha256_file(local)}


def new_manifest(*, step: int, world_size: int, config_hash: str, files: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": MANIFEST_VERSION, "step": step, "world_size": world_size, "config_hash": config_hash,
            "files": sorted(files, key=lambda f: f["path"]), "created_unix": time.time()}


def read_pointer(loc: Location) -> dict[str, Any] | None:
    raw = loc.store.get_bytes(loc.key(LATEST))
    if raw is None:
        return None
    try:
        pointer = json.loads(raw)
        return pointer if isinstance(pointer, dict) and isinstance(pointer.get("step_dir"), str) else None
    except ValueError:
        return None


def commit(loc: Location, step_dir: str, manifest: bytes, *, step: int, write_manifest: bool = True,
           supersede: frozenset[str] = frozenset()) -> bool:
    """The last two writes of a commit: ``manifest.json``, then ``latest`` (unless ``latest`` names
    a newer step, which it keeps, except for one of ``supersede``: checkpoints a resume rejected).
    Call once every object is stored. Returns whether ``latest`` moved."""
    if write_manifest:
        loc.store.put_bytes(manifest, loc.key(step_dir, MANIFEST))
    current = read_pointer(loc)
    if (current and current.get("step", -1) > step and current["step_dir"] != step_dir
            and current["step_dir"] not in supersede):
        # An older checkpoint committed late (a retried upload) never moves `latest` backwards.
        log.warning("%s committed, but `latest` stays on the newer %s", loc.uri(step_dir), current["step_dir"])
        return False
    pointer = {"step_dir": step_dir, "step": step, "manifest_sha256": hashlib.sha256(manifest).hexdigest()}
    loc.store.put_bytes(json.dumps(pointer).encode(), loc.key(LATEST))
    return True


def read_commit(loc: Location) -> dict[str, Any]:
    """What ``latest`` names: ``{"uri", "step_dir", "step"}``; StoreError when nothing is committed."""
    pointer = read_pointer(loc)
    if pointer is None:
        raise StoreError(f"{loc.uri(LATEST)} does not exist or is unreadable: no checkpoint was committed there")
    return {"uri": loc.uri(pointer["step_dir"]), "step_dir": pointer["step_dir"], "step": int(pointer["step"])}


@dataclass
class Committed:
    uri: str
    step_dir: str
    manifest: dict[str, Any]
    uploaded: int
    skipped: int
    seconds: float


def upload_checkpoint(local_dir: str | Path, store_uri: str, *, experiment: str, run_id: str,
                      env: Mapping[str, str] | None = None) -> Committed:
    """Commit one local checkpoint folder (written by the trainer with its own manifest) to the
    store; safe to re-run (task retries). Every file is checked against the local manifest first,
    so a damaged local copy is never published. ``env``: S3 settings (see s3_store.S3Store)."""
    t0 = time.perf_counter()
    local_dir = Path(local_dir)
    step_dir = check_path_part("checkpoint folder", local_dir.name)
    if not (local_dir / MANIFEST).is_file():
        raise StoreError(f"{local_dir} has no {MANIFEST}: the save was interrupted; refusing to upload it")
    raw = (local_dir / MANIFEST).read_bytes()
    manifest = json.loads(raw)
    for f in manifest["files"]:
        verified_file(Location(FileStore(local_dir.parent)), step_dir, f, local_dir)
    loc = run_location(store_uri, experiment, run_id, env)
    existing = loc.store.get_bytes(loc.key(step_dir, MANIFEST))
    if existing is not None:
        if _file_set(json.loads(existing)) != _file_set(manifest):
            raise StoreError(f"{loc.uri(step_dir)} is already committed with different content; "
                             "a committed checkpoint is never overwritten (start a new MLflow run instead)")
        raw, manifest = existing, json.loads(existing)
    uploaded = skipped = 0
    for f in manifest["files"]:
        key = loc.key(step_dir, f["path"])
        st = loc.store.stat(key)
        if st and st["size"] == f["size"] and loc.store.sha256(key) == f["sha256"]:
            skipped += 1
            continue
        loc.store.put_file(local_dir / f["path"], key, f["sha256"])
        uploaded += 1
    commit(loc, step_dir, raw, step=manifest["step"], write_manifest=existing is None)
    return Committed(uri=loc.uri(step_dir), step_dir=step_dir, manifest=manifest, uploaded=uploaded, skipped=skipped,
                     seconds=time.perf_counter() - t0)


def _file_set(manifest: dict[str, Any]) -> set[tuple[str, int, str]]:
    return {(f["path"], f["size"], f["sha256"]) for f in manifest["files"]}


# --------------------------------------------------------------------------- reading


@dataclass
class Candidate:
    """A checkpoint a reader may try: its manifest, or why it is not even worth trying."""

    step_dir: str
    manifest: dict[str, Any] | None
    problem: str | None = None


def candidates(loc: Location, step_dir: str | None = None) -> Iterator[Candidate]:
    """Checkpoints to try, best first: the one ``latest`` names, then every other step folder,
    newest first (``step_dir``: that one only). A folder without a readable manifest, or whose
    manifest is not the one ``latest`` committed, comes with its problem instead of a manifest."""
    pointer = read_pointer(loc)
    if step_dir is not None:
        names = [check_path_part("step_dir", step_dir)]
    else:
        if pointer is None and loc.store.get_bytes(loc.key(LATEST)) is not None:
            yield Candidate(LATEST, None, "`latest` is unreadable, ignored; trying every checkpoint, newest first")
        first = [pointer["step_dir"]] if pointer else []
        names = first + [d for d in sorted(loc.store.list_dirs(loc.prefix), reverse=True)
                         if d not in first and d.startswith("step_")]
    for name in names:
        raw = loc.store.get_bytes(loc.key(name, MANIFEST))
        if raw is None:
            yield Candidate(name, None, f"{name}: no manifest (incomplete upload), ignored")
            continue
        try:
            manifest = json.loads(raw)
            if not isinstance(manifest["files"], list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            yield Candidate(name, None, f"{name}: manifest unreadable, ignored")
            continue
        if pointer and name == pointer["step_dir"] and pointer.get("manifest_sha256") not in (
                None, hashlib.sha256(raw).hexdigest()):
            yield Candidate(name, None, f"{name}: manifest differs from the one `latest` committed; "
                                        "falling back to an older checkpoint")
            continue
        yield Candidate(name, manifest)


def verified_file(loc: Location, step_dir: str, entry: dict[str, Any], cache: Path, *, copy: bool = False) -> Path:
    """The object ``step_dir/entry['path']`` as a local file whose size and sha256 match the
    manifest entry: read in place from a folder store (``copy``: copied into ``cache`` first), downloaded
    into ``cache`` from S3. CheckpointCorrupt, starting with ``step_dir/path``, if it is not."""
    name = f"{step_dir}/{entry['path']}"
    key = loc.key(step_dir, entry["path"])
    local = loc.store.local_path(key)
    try:
        if local is None or copy:
            target = cache / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if local is None:
                loc.store.get_file(key, target)
            else:
                shutil.copyfile(local, target)
            local = target
        size = local.stat().st_size
    except (CheckpointCorrupt, FileNotFoundError):
        raise CheckpointCorrupt(f"{name} is missing from {loc.uri()}") from None
    if size != entry["size"]:
        raise CheckpointCorrupt(f"{name} has {size} bytes, its manifest says {entry['size']}")
    if sha256_file(local) != entry["sha256"]:
        raise CheckpointCorrupt(f"{name} does not match its manifest sha256")
    return local


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
    loc = run_location(store_uri, experiment, run_id, env)
    warnings: list[str] = []
    for c in candidates(loc, step_dir):
        if c.manifest is None:
            warnings.append(c.problem)
            continue
        local = Path(dest) / c.step_dir
        local.mkdir(parents=True, exist_ok=True)
        try:
            for f in c.manifest["files"]:
                if only is None or f["path"] in only:
                    verified_file(loc, c.step_dir, f, local, copy=True)
        except (CheckpointCorrupt, OSError) as e:
            warnings.append(f"{e}; falling back to an older checkpoint")
            shutil.rmtree(local, ignore_errors=True)
            continue
        for w in warnings:
            log.warning("checkpoint fallback: %s", w)
        return local, c.manifest, warnings
    raise StoreError(f"no verified checkpoint under {loc.uri()} ({'; '.join(warnings) or 'nothing uploaded'})")


# --------------------------------------------------------------------------- retention


def write_eval(loc: Location, step_dir: str, metrics: Mapping[str, float]) -> None:
    """A checkpoint's evaluation next to its manifest (not part of it), for the best-by-eval rule."""
    loc.store.put_bytes(json.dumps({k: float(v) for k, v in metrics.items()}).encode(),
                        loc.key(check_path_part("step_dir", step_dir), EVAL_FILE))


def record_eval(store_uri: str, *, experiment: str, run_id: str, step_dir: str, metrics: dict[str, float],
                env: Mapping[str, str] | None = None) -> None:
    write_eval(run_location(store_uri, experiment, run_id, env), step_dir, metrics)


@dataclass
class Retention:
    kept: list[str]
    deleted: list[str]
    reasons: dict[str, str]


def retain(loc: Location, *, keep_last: int, metric: str = "eval/loss", mode: str = "min") -> Retention:
    """Delete old checkpoints, keeping the last ``keep_last`` committed ones, the best one by
    ``metric`` (from ``eval.json``), and always the one ``latest`` points to.

    ``keep_last=0`` keeps everything. Folders without a manifest older than the newest committed
    checkpoint are leftovers of failed saves and go too; newer ones may be a save in progress
    and stay. Each doomed checkpoint loses its manifest first, so a reader never trusts a half-deleted
    one. Call it only after the newest commit returned (it is then durable). (Hand-written: S3
    lifecycle rules expire by age, not by rank or score.)
    """
    if keep_last < 0:
        raise ConfigError("retention_keep_last", f"{keep_last} is negative", "use 0 (keep all) or a positive count")
    if mode not in ("min", "max"):
        raise ConfigError("retention mode", f"{mode!r} is not supported", "use 'min' or 'max'")
    store = loc.store
    dirs = sorted(d for d in store.list_dirs(loc.prefix) if d.startswith("step_"))
    if keep_last == 0:
        return Retention(kept=dirs, deleted=[], reasons={d: "keep_last=0 keeps all" for d in dirs})
    committed = [d for d in dirs if store.stat(loc.key(d, MANIFEST)) is not None]
    reasons: dict[str, str] = {}
    pointer = read_pointer(loc)
    if pointer and pointer["step_dir"] in dirs:
        reasons[pointer["step_dir"]] = "latest"
    for d in committed[-keep_last:]:
        reasons.setdefault(d, f"among the last {keep_last}")
    scored = []
    for d in committed:
        raw = store.get_bytes(loc.key(d, EVAL_FILE))
        value = json.loads(raw).get(metric) if raw else None
        if isinstance(value, (int, float)) and value == value:
            scored.append((value if mode == "min" else -value, d))
    if scored:
        reasons.setdefault(min(scored)[1], f"best {metric}")
    newest = committed[-1] if committed else None
    for d in dirs:
        if d not in committed and newest is not None and d > newest:
            reasons.setdefault(d, "newer than every committed checkpoint (a save may be in progress)")
    doomed = [d for d in dirs if d not in reasons]
    for d in doomed:
        store.delete([loc.key(d, MANIFEST)])  # untrusted from here on
        store.delete(store.list_keys(loc.key(d)))
        log.info("retention: deleted %s", loc.uri(d))
    return Retention(kept=[d for d in dirs if d in reasons], deleted=doomed, reasons=reasons)


def apply_retention(store_uri: str, *, experiment: str, run_id: str, keep_last: int, metric: str = "eval/loss",
                    mode: str = "min", env: Mapping[str, str] | None = None) -> Retention:
    """``retain`` on a pipeline run's checkpoints in ``store_uri``."""
    return retain(run_location(store_uri, experiment, run_id, env), keep_last=keep_last, metric=metric, mode=mode)
