"""Tables streamed: a split's rows read Parquet row group by row group, never whole.
``TableParts`` gives each row group's rows of a split (in the one-table layout, the rows
training/data/split.py puts on that side); ``label_scan`` and ``scan`` are the passes the
description and the normalization statistics need; ``ParquetBlocks`` is the block source
``StreamLoader`` (training/data/stream.py) serves a rank's batches from. Why row groups and not a
library's reader: docs/decisions/0009-streamed-training-data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from training.config.fields import ConfigError
from training.data.arrays import Columns, to_arrays
from training.data.options import DataOptions
from training.data.sources import TABLE, Layout
from training.data.split import validation_rows

MiB = 1 << 20


@dataclass(frozen=True)
class Group:
    """One Parquet row group: where it is, its rows (both sides of a one-table split) and its
    decoded size (what reading it allocates for a moment)."""

    file: Path
    index: int
    rows: int
    nbytes: int


class TableParts:
    """Split ``split`` of ``layout`` as row groups; ``read(group)`` gives the group's rows of it."""

    def __init__(self, layout: Layout, split: str, options: DataOptions):
        import pyarrow.parquet as pq

        self.one_table = TABLE in layout.files
        self.split, self.options = split, options
        self.groups: list[Group] = []
        self.schema = None
        for f in layout.files[TABLE if self.one_table else split]:
            with pq.ParquetFile(str(f.local)) as pf:
                md = pf.metadata
                self.schema = self.schema if self.schema is not None else pf.schema_arrow
                self.groups += [Group(f.local, i, md.row_group(i).num_rows, md.row_group(i).total_byte_size)
                                for i in range(md.num_row_groups)]

    def read(self, group: Group, columns: list[str] | None = None):
        """The group's rows of this split as an Arrow table (``columns`` only, when given). One
        table: every column is read, as the split's row hash covers them all."""
        import pyarrow.parquet as pq

        with pq.ParquetFile(str(group.file)) as pf:
            table = pf.read_row_group(group.index, columns=None if self.one_table else columns)
        if self.one_table:
            val = validation_rows(table, self.options.validation_fraction, self.options.split_seed)
            table = table.filter(val if self.split == "validation" else ~val)
            if columns is not None:
                table = table.select(columns)
        return table

    def key(self) -> dict[str, Any]:
        """What decides which rows are this split's (with the data's fingerprint: a cache key)."""
        out: dict[str, Any] = {"split": self.split}
        if self.one_table:
            out.update(validation_fraction=self.options.validation_fraction, split_seed=self.options.split_seed)
        return out


def label_scan(parts: TableParts, label: str) -> tuple[int, Any]:
    """(missing values, distinct values) of column ``label``, one row group at a time: what
    ``describe`` needs of train to infer the task and the classes (training/data/schema.py)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from training.data.schema import _missing

    missing, distinct = 0, None
    for g in parts.groups:
        col = parts.read(g, [label]).column(label)
        missing += _missing(col)
        seen = pc.unique(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
        distinct = seen if distinct is None else pc.unique(pa.concat_arrays([distinct, seen]))
    if distinct is None:
        distinct = pa.array([], type=parts.schema.field(label).type)
    return missing, distinct


@dataclass
class Scan:
    """One pass over a split: its rows per row group, and the mean and standard deviation of the
    features and of the label, as the model reads them (float32, then float64 arithmetic)."""

    counts: list[int]
    stats: dict[str, tuple[np.ndarray, np.ndarray]]  # "features" / "labels" -> (mean, std), float64


class _Moments:
    """Count, mean and sum of squared deviations per column, merged part by part (Chan et al.'s
    pairwise update). A single part gives numpy's own ``mean`` and ``std``, bit for bit."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, None, None

    def add(self, v: np.ndarray) -> None:
        v = np.asarray(v, dtype=np.float64).reshape(len(v), -1)
        if not len(v):
            return
        n = len(v)
        mean = v.sum(axis=0) / n
        d = v - mean
        m2 = (d * d).sum(axis=0)
        if self.n == 0:
            self.n, self.mean, self.m2 = n, mean, m2
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.n * n / total)
        self.n = total

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.mean, np.sqrt(self.m2 / self.n)


def cached(key: dict[str, Any], compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``compute()`` (a JSON object) kept in the machine's cache under ``key`` (which names the
    data by its fingerprint): the ranks of one machine, and a restart, pass over the data once.
    A lock around it; an unreadable entry is computed again."""
    from filelock import FileLock

    from training.util import atomic_write, machine_cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    folder = machine_cache_dir() / "table_passes"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.json"
    with FileLock(str(path) + ".lock"):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        value = compute()
        atomic_write(path, json.dumps(value), tmp_suffix=f".tmp{os.getpid()}")
        return value


def label_scan_cached(parts: TableParts, label: str, fingerprint: str) -> tuple[int, Any]:
    """``label_scan`` through the machine's cache."""
    import pyarrow as pa

    def compute() -> dict[str, Any]:
        missing, values = label_scan(parts, label)
        return {"missing": missing, "values": values.to_pylist()}

    got = cached({"pass": "label", "data": fingerprint, **parts.key(), "label": label}, compute)
    return got["missing"], pa.array(got["values"], type=parts.schema.field(label).type)


def scan_cached(parts: TableParts, columns: Columns, fingerprint: str, *, features: bool, labels: bool) -> Scan:
    """``scan`` through the machine's cache."""
    def compute() -> dict[str, Any]:
        found = scan(parts, columns, features=features, labels=labels)
        return {"counts": found.counts, "stats": {k: [m.tolist(), d.tolist()] for k, (m, d) in found.stats.items()}}

    key = {"pass": "scan", "data": fingerprint, **parts.key(), "columns": dataclasses.asdict(columns),
           "features": features, "labels": labels}
    got = cached(key, compute)
    return Scan(counts=got["counts"], stats={k: (np.asarray(m), np.asarray(d)) for k, (m, d) in got["stats"].items()})


def _to_read(parts: TableParts, columns: Columns) -> list[str] | None:
    """The columns to read of each row group (None: every column, as the one-table split needs)."""
    return None if parts.one_table else [*columns.features, *([columns.label] if columns.label else [])]


def scan(parts: TableParts, columns: Columns, *, features: bool, labels: bool) -> Scan:
    """Rows per row group and (when asked) the statistics of ``columns`` over the whole split,
    reading one row group at a time."""
    need = _to_read(parts, columns)
    counts, fm, lm = [], _Moments(), _Moments()
    for g in parts.groups:
        if not (features or labels or parts.one_table):
            counts.append(g.rows)  # rows from the footer: nothing to read
            continue
        table = parts.read(g, need)
        counts.append(table.num_rows)
        if features or labels:
            s = to_arrays(table, columns)
            if features:
                fm.add(s.features)
            if labels and s.labels is not None:
                lm.add(s.labels)
        del table
    if not sum(counts):
        raise ConfigError("dataset_uri", f"the {parts.split} split has no rows", "give data with rows in both splits")
    stats = {}
    if features:
        stats["features"] = fm.result()
    if labels and lm.n:
        stats["labels"] = lm.result()
    return Scan(counts=counts, stats=stats)


class ParquetBlocks:
    """A table's split to stream: a block is one row group's rows of the split (groups with none
    are left out); a window holds about ``shuffle_window`` MiB of rows as the model reads them."""

    def __init__(self, parts: TableParts, columns: Columns, counts: list[int]):
        self.parts, self.columns = parts, columns
        kept = [(g, n) for g, n in zip(parts.groups, counts) if n > 0]
        self.groups = [g for g, _ in kept]
        self.sizes = [n for _, n in kept]
        self.dtype = np.dtype(np.int64 if columns.integer_features else np.float32)
        self.label_dtype = np.dtype(np.float32 if columns.task == "regression" else np.int64)
        self.row_bytes = len(columns.features) * self.dtype.itemsize + (
            self.label_dtype.itemsize if columns.label else 0)
        self.read_columns = _to_read(parts, columns)

    def window_for(self, shuffle_window: int) -> int:
        """Blocks per shuffle window: about ``shuffle_window`` MiB of rows (token shards' blocks are
        1 MiB each), at least one row group. Depends on the data alone, so every world size agrees."""
        per_block = max(1, int(np.mean(self.sizes)) * self.row_bytes)
        return max(1, shuffle_window * MiB // per_block)

    def held_bytes(self, window: int) -> int:
        """The most a ``StreamLoader`` holds: two windows of the largest blocks' rows, and one row
        group decoded by Arrow while it is read."""
        largest = sorted(self.sizes, reverse=True)[: 2 * window]
        return sum(largest) * self.row_bytes + max(g.nbytes for g in self.groups)

    def read_window(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows of ``blocks`` (ascending) as the model reads them, one array each."""
        if not len(blocks):  # an evaluating rank whose share ran out still runs its forward
            return (np.empty((0, len(self.columns.features)), dtype=self.dtype),
                    np.empty(0, dtype=self.label_dtype) if self.columns.label else None)
        parts = [to_arrays(self.parts.read(self.groups[b], self.read_columns), self.columns) for b in blocks.tolist()]
        x = parts[0].features if len(parts) == 1 else np.concatenate([p.features for p in parts])
        if parts[0].labels is None:
            return x, None
        y = parts[0].labels if len(parts) == 1 else np.concatenate([p.labels for p in parts])
        return x, y
