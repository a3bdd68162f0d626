"""Retention: which committed checkpoints of a run are kept (the last K, the best by evaluation,
whatever ``latest`` names) and the evaluation recorded next to each for that choice. Hand-written:
S3 lifecycle rules expire by age, not by rank or score."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Mapping

from training.checkpoint.commit import EVAL_FILE, MANIFEST, Location, read_pointer, run_location
from training.config.fields import ConfigError
from training.config.train_config import check_path_part

log = logging.getLogger(__name__)

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
