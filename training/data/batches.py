"""A split read as a pass over its Parquet row groups (``split_batches``: batches of ``rows`` rows,
the last fewer; a one-table layout's rows filtered to the split by training/data/split.py, which
decides per row), and what the data gate needs of the whole split from such a pass (``Totals``:
rows, row hashes for duplicates, label counts, a merged column profile; ``split_rows`` sizes its
hash buffer), and ``release_memory``, which hands freed allocator pages back between batches. The
gate's batched mode (training/data/gate.py) checks data larger than memory this way."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from training.data.options import DataOptions
from training.data.schema import NUMERIC, family, type_name
from training.data.sources import TABLE, Layout
from training.data.split import validation_rows


def split_batches(layout: Layout, split: str, options: DataOptions, rows: int) -> Iterator[Any]:
    """Arrow tables of at most ``rows`` rows of ``split``, file by file, row group by row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    one_table = TABLE in layout.files

    def cut(table):
        if one_table:
            val = validation_rows(table, options.validation_fraction, options.split_seed)
            table = table.filter(val if split == "validation" else ~val)
        return table

    pending = None  # rows read and not yet handed out: fewer than ``rows`` plus one row group

    def take(n: int):
        # The rows handed out are dropped from ``pending`` before the batch is: while the caller
        # works on a batch, this generator holds no other copy of its rows.
        nonlocal pending
        batch = pending.slice(0, n).combine_chunks()
        pending = pending.slice(n) if pending.num_rows > n else None
        release_memory()  # the row groups just combined, before the caller's work on the batch
        return cut(batch)

    for f in layout.files[TABLE if one_table else split]:
        pf = pq.ParquetFile(f.local)
        # read_row_group, not iter_batches: pyarrow's batch reader kept every batch's buffers
        # allocated until the file was done (measured: 260 MiB after 10 batches of 250,000 rows).
        for i in range(pf.metadata.num_row_groups):
            group = pf.read_row_group(i)
            pending = group if pending is None else pa.concat_tables([pending, group])
            del group
            while pending is not None and pending.num_rows >= rows:
                yield take(rows)
        if pending is not None and pending.num_rows:
            yield take(pending.num_rows)
        pending = None  # batches do not span files


def split_rows(layout: Layout, split: str) -> int:
    """Rows of ``split`` by the Parquet footers (a one-table layout: its whole table's, a bound);
    0 when a footer cannot be read (the pass itself then reports the file)."""
    import pyarrow.parquet as pq

    try:
        files = layout.files[TABLE if TABLE in layout.files else split]
        return sum(pq.ParquetFile(f.local).metadata.num_rows for f in files)
    except Exception:  # corrupt / truncated file: pyarrow raises several types
        return 0


def release_memory() -> None:
    """Hand the memory freed by a batch back to the system before the next: pyarrow's allocator
    and glibc's malloc keep freed pages, which the next batch's buffers reuse only in part (a
    batch's peak rose by tens of MiB over ten batches without it)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    if _malloc_trim is not None:
        _malloc_trim(0)


try:  # glibc's; no library exposes it (elsewhere the system allocator returns pages itself)
    _malloc_trim = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError):
    _malloc_trim = None


@dataclass
class Totals:
    """What the whole-split checks need, accumulated batch by batch (8 bytes a row for the row hashes)."""

    hashed: list[str]  # columns in the row hash (duplicates)
    label: str | None
    rows: int = 0
    # One buffer for the row hashes, made for ``capacity`` rows (the split's rows by the Parquet
    # footers): no list of per-batch arrays to concatenate at the end. Pages not yet written take
    # no memory, so a one-table layout's bound (its whole table) costs only the rows hashed.
    capacity: int = 0
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    n_hashed: int = 0
    labels: dict[Any, int] = field(default_factory=dict)
    columns: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> running profile

    def add(self, table, df) -> None:
        import pandas as pd
        import pyarrow.compute as pc

        self.rows += table.num_rows
        if self.hashed and all(c in df.columns for c in self.hashed):
            self.add_hashes(pd.util.hash_pandas_object(df[self.hashed], index=False).to_numpy())
        if self.label and self.label in table.column_names:
            for c in pc.value_counts(table.column(self.label)).to_pylist():
                self.labels[c["values"]] = self.labels.get(c["values"], 0) + int(c["counts"])
        for name in table.column_names:
            col = table.column(name)
            p = self.columns.setdefault(name, {"name": name, "type": type_name(col.type), "dtype": family(col.type),
                                               "missing": 0, "n": 0, "sum": 0.0, "sumsq": 0.0})
            values = None
            if p["dtype"] in NUMERIC:
                values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
                p["missing"] += int(np.isnan(values).sum())
                values = values[np.isfinite(values)]
            else:
                p["missing"] += col.null_count
            if values is not None and len(values):
                p["min"] = min(p.get("min", np.inf), float(values.min()))
                p["max"] = max(p.get("max", -np.inf), float(values.max()))
                p["n"] += len(values)
                p["sum"] += float(values.sum())
                p["sumsq"] += float(np.square(values).sum())

    def add_hashes(self, h: np.ndarray) -> None:
        end = self.n_hashed + len(h)
        if end > len(self.hashes):  # first batch, or more rows than the footers said
            grown = np.empty(max(end, self.capacity, 2 * len(self.hashes)), dtype=np.uint64)
            grown[:self.n_hashed] = self.hashes[:self.n_hashed]
            self.hashes = grown
        self.hashes[self.n_hashed:end] = h
        self.n_hashed = end

    def duplicated(self) -> int:
        """Rows that have an equal row elsewhere in the split (every row of a group counts)."""
        # Sorted in place, each row compared with its neighbours: 2 bytes a row besides the hashes,
        # where np.unique(return_inverse, return_counts) took ~60 (measured: +148 MiB over 2.5M rows).
        h = self.hashes[:self.n_hashed]
        h.sort()
        same = h[1:] == h[:-1]  # a row equal to the next one (sorted): both are duplicated
        dup = np.zeros(len(h), dtype=bool)
        dup[1:] = same
        dup[:-1] |= same
        return int(np.count_nonzero(dup))

    def profile(self) -> list[dict[str, Any]]:
        """training.data.schema.profile's entries, from the running sums (std: the population's)."""
        out = []
        for p in self.columns.values():
            entry = {k: p[k] for k in ("name", "type", "dtype", "missing")}
            if p["dtype"] in NUMERIC and p["n"]:
                mean = p["sum"] / p["n"]
                entry.update(min=p["min"], max=p["max"], mean=mean, std=max(p["sumsq"] / p["n"] - mean * mean, 0.0) ** 0.5)
            out.append(entry)
        return out
