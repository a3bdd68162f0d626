"""The commit protocol of checkpoints, the same for every checkpoint and every store (training/store/).

Layout (``Location``: a store and a prefix; the trainer's ``checkpoint_dir`` is a store with an
empty prefix, the pipeline's is ``{experiment}/{mlflow_run_id}`` in ``store_uri``)::

    {location}/step_{step:08d}/<files>         DCP shards, .metadata, rng_rankN.pt (+ the model, final step)
    {location}/step_{step:08d}/manifest.json   written after every file: each file's size and sha256
    {location}/step_{step:08d}/eval.json       evaluation (not in the manifest), for retention
    {location}/latest                          written after the manifest: step folder + manifest sha256

Each write returns once stored, so a failure anywhere leaves ``latest`` on the previous checkpoint.
A reader trusts a checkpoint only when its manifest is present (and is the one ``latest`` recorded)
and every object it reads matches it (else ``CheckpointCorrupt``), and otherwise falls back to the
next older one, saying why (``candidates``, ``verified_file``). Retention: checkpoint/retention.py.
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

from training.config.train_config import check_path_part
from training.store import Store, StoreError, open_store
from training.store.base import ObjectMissing
from training.store.file import FileStore
from training.util import sha256_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
EVAL_FILE = "eval.json"
MANIFEST_VERSION = 1


class CheckpointCorrupt(StoreError):
    """An object is missing, truncated or differs from its manifest."""


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


# --------------------------------------------------------------------------- writing


def file_entry(name: str, local: Path) -> dict[str, Any]:
    """A manifest entry: computed by the process that wrote ``local``."""
    return {"path": name, "size": local.stat().st_size, "sha256": sha256_file(local)}


def new_manifest(*, step: int, world_size: int, config_hash: str, files: list[dict[str, Any]],
                 base: dict[str, str] | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base``: the frozen weights an adapter's checkpoint trained on and needs again (not in it);
    ``settings``: the run's fields that ``config_hash`` hashes (``TrainConfig.weight_settings``)."""
    out = {"version": MANIFEST_VERSION, "step": step, "world_size": world_size, "config_hash": config_hash,
           "files": sorted(files, key=lambda f: f["path"]), "created_unix": time.time()}
    if base is not None:
        out["base"] = dict(base)
    if settings is not None:
        out["settings"] = dict(settings)
    return out


def settings_changed(manifest: dict[str, Any], config_hash: str, settings: dict[str, Any]) -> list[str]:
    """What differs between the settings a checkpoint was saved under and this run's, as
    ``field old -> new`` (a manifest from before settings were recorded: its hash only); [] if none."""
    if manifest.get("config_hash") in (None, config_hash):
        return []
    was = manifest.get("settings")
    if was is None:
        return [f"config_hash {manifest['config_hash']} -> {config_hash}"]
    return [f"{k} {was.get(k, '(unset)')!r} -> {settings.get(k, '(unset)')!r}" for k in sorted(set(was) | set(settings))
            if was.get(k) != settings.get(k)]


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
    so a damaged local copy is never published. ``env``: S3 settings (see store/s3.py's S3Store)."""
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
    except (ObjectMissing, FileNotFoundError):
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


# Retention (which committed checkpoints are kept) is training/checkpoint/retention.py.
