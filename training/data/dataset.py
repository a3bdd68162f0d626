"""The arrays training reads: ``open_dataset`` opens a ``dataset_uri`` (its layout, description and
splits, each read once) and ``Dataset.split(name, spec)`` gives a split's features (float32
``[n, d]``; int64 token sequences) and labels (class indices, mapped through ``classes`` when they
are not 0..C-1; float32 targets for regression; none for tokens) for the columns the model spec
names, or without one the dataset's description; ``Dataset.stream(name, ...)`` the same, row group
by row group (training/data/table_stream.py). Data that changed since the gate is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from training.config.fields import ConfigError
from training.data.schema import DatasetSchema, declares_schema, describe, infer_schema, profile, schema_from_meta
from training.data.options import DataOptions
from training.data.sources import TABLE, Layout, discover, read_files
from training.data.arrays import Columns, Split, to_arrays
from training.data.split import validation_rows
from training.data.table_stream import ParquetBlocks, TableParts, label_scan_cached, scan_cached


class Dataset:
    """A ``dataset_uri`` opened: its layout (files, fingerprint), its description (``meta``), and
    its splits, each read once. Reading is lazy: the gate reads a split where it can report on it."""

    def __init__(self, layout: Layout, options: DataOptions):
        self.layout, self.options = layout, options
        self._tables: dict[str, Any] = {}
        self._parts: dict[str, TableParts] = {}
        self._meta: dict[str, Any] | None = None
        self._profile: list[dict[str, Any]] | None = None

    @property
    def uri(self) -> str:
        return self.layout.uri

    @property
    def fingerprint(self) -> str:
        return self.layout.fingerprint

    def table(self, split: str):
        """The split as an Arrow table (one table's split: the rows ``validation_rows`` picks)."""
        if split not in self._tables:
            if split in self.layout.files:
                self._tables[split] = read_files(self.layout.files[split])
            else:
                whole = read_files(self.layout.files[TABLE])
                val = validation_rows(whole, self.options.validation_fraction, self.options.split_seed)
                self._tables["train"], self._tables["validation"] = whole.filter(~val), whole.filter(val)
        return self._tables[split]

    def parts(self, split: str) -> TableParts:
        """Split ``split`` row group by row group (training/data/table_stream.py); its files'
        footers are read once."""
        if split not in self._parts:
            self._parts[split] = TableParts(self.layout, split, self.options)
        return self._parts[split]

    @property
    def meta(self) -> dict[str, Any]:
        """The description (training.data.schema.describe); ConfigError names a field to fix. A
        table's is inferred from train read one row group at a time (its label column only, but
        every column in the one-table layout, whose split hashes them); text reads train whole."""
        if self._meta is None:
            if self.options.is_text:
                self._meta = describe(self.layout.meta, self.options, lambda: self.table("train"))
            else:
                parts = self.parts("train")
                self._meta = describe(self.layout.meta, self.options, lambda: parts.schema.empty_table(),
                                      label_scan=lambda label: label_scan_cached(parts, label, self.fingerprint))
        return self._meta

    def declared_schema(self) -> DatasetSchema | None:
        """The gate's schema from dataset.json; None when it is to be inferred from train."""
        return schema_from_meta(self.layout.meta) if declares_schema(self.layout.meta) else None

    def train_profile(self) -> list[dict[str, Any]]:
        if self._profile is None:
            self._profile = profile(self.table("train"))
        return self._profile

    def gate_schema(self) -> DatasetSchema:
        declared = self.declared_schema()
        return declared if declared is not None else infer_schema(self.table("train"), self.meta, self.train_profile())

    def columns(self, spec: Any = None) -> Columns:
        """What to read for a model (a training.models.spec.ModelSpec) or, without one, what the
        dataset's description names."""
        meta = self.meta
        described = Columns(features=list(meta["features"]), label=meta.get("label"),
                            task=meta.get("task", "classification"), classes=meta.get("classes"),
                            integer_features=meta.get("feature_dtype") == "int")
        if spec is None:
            return described
        if spec.label_from_data:  # a model_config.json written before the spec named its label and task
            return Columns(features=list(spec.features), label=described.label, task=described.task,
                           classes=spec.classes, integer_features=described.integer_features)
        return Columns(features=list(spec.features), label=spec.label, task=spec.task, classes=spec.classes,
                       integer_features=spec.kind == "tokens")

    def stream(self, name: str, shuffle_window: int) -> tuple[Split, ParquetBlocks]:
        """Split ``name`` to stream (training/data/stream.py): its first two rows (the model's
        check), with the whole split's statistics where the description asks for them (one pass,
        one row group at a time) and what a rank holds of it; and its blocks."""
        meta, columns = self.meta, self.columns()
        parts = self.parts(name)
        normalize = bool(meta.get("normalize")) and meta.get("kind") == "tabular"
        regression = columns.task == "regression" and meta.get("kind") == "tabular"
        found = scan_cached(parts, columns, self.fingerprint, features=normalize, labels=regression)
        blocks = ParquetBlocks(parts, columns, found.counts)
        head = self.split(name, limit=2)
        head.stats = found.stats
        head.held_bytes = blocks.held_bytes(blocks.window_for(shuffle_window))
        return head, blocks

    def blocks(self, name: str, spec: Any = None) -> ParquetBlocks:
        """Split ``name`` to read block by block (a row group's rows a block) as ``columns(spec)``
        says; ValueError when the split lacks a column the model reads."""
        parts, columns = self.parts(name), self.columns(spec)
        missing = [c for c in columns.features if c not in parts.schema.names]
        if missing:
            raise ValueError(f"model was trained on features {columns.features} but the dataset lacks {missing}")
        return ParquetBlocks(parts, columns, scan_cached(parts, columns, self.fingerprint, features=False,
                                                         labels=False).counts)

    def split(self, name: str, spec: Any = None, *, limit: int | None = None) -> Split:
        """Arrays of split ``name`` as ``columns(spec)`` says; ``limit``: the first rows only (read
        row group by row group until there are enough)."""
        if limit is None or name in self._tables:
            table = self.table(name)
            return to_arrays(table if limit is None else table.slice(0, limit), self.columns(spec))
        import pyarrow as pa

        got, rows = [], 0
        parts = self.parts(name)
        for g in parts.groups:
            if rows >= limit:
                break
            got.append(parts.read(g))
            rows += got[-1].num_rows
        table = pa.concat_tables(got) if got else parts.schema.empty_table()
        return to_arrays(table.slice(0, limit), self.columns(spec))


def open_dataset(uri: str | Path, options: DataOptions | None = None, *, env: Mapping[str, str] | None = None,
                 expect_fingerprint: str | None = None) -> Dataset:
    """Open ``uri`` for training: a usable layout or a ConfigError naming ``dataset_uri``; with
    ``expect_fingerprint`` (what the data gate recorded), data that changed since is refused."""
    ds = Dataset(discover(str(uri), env=env).require(), options or DataOptions())
    if expect_fingerprint and ds.fingerprint != expect_fingerprint:
        raise ConfigError("dataset_fingerprint", f"the data under {uri} changed after the data gate passed it "
                          f"(gate {expect_fingerprint[:16]}, now {ds.fingerprint[:16]})",
                          "trigger a new run, so that the gate checks the data as it is now")
    return ds


def load_split(root: str | Path | Dataset, split: str, spec: Any = None) -> Split:
    """Split ``split`` of a dataset (a Dataset, or a folder opened with the default options)."""
    ds = root if isinstance(root, Dataset) else open_dataset(root)
    return ds.split(split, spec)
