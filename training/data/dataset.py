"""The arrays training reads: ``open_dataset`` opens a ``dataset_uri`` (its layout, description and
splits, each read once) and ``Dataset.split(name, spec)`` gives a split's features (float32
``[n, d]``; int64 token sequences) and labels (class indices, mapped through ``classes`` when they
are not 0..C-1; float32 targets for regression; none for tokens) for the columns the model spec
names, or without one the dataset's description. Data that changed since the gate is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from training.config.fields import ConfigError
from training.data.schema import DatasetSchema, declares_schema, describe, infer_schema, profile, schema_from_meta
from training.data.options import DataOptions
from training.data.sources import TABLE, Layout, discover, read_files
from training.data.split import validation_rows


@dataclass(frozen=True)
class Columns:
    """What to read of a table: the feature columns (int64 for token ids, else float32), the label,
    and how its values map to targets (classes by index, a regression label as it is)."""

    features: list[str]
    label: str | None
    task: str
    classes: list[Any] | None
    integer_features: bool


@dataclass
class Split:
    features: np.ndarray  # float32 [n, d] (tabular, images) or int64 [n, seq_len + 1] (tokens)
    labels: np.ndarray | None  # int64 class indices [n], float32 targets [n] (regression); None for tokens
    held_bytes: int | None = None  # what a rank holds of the split when streamed (None: these arrays)


class Dataset:
    """A ``dataset_uri`` opened: its layout (files, fingerprint), its description (``meta``), and
    its splits, each read once. Reading is lazy: the gate reads a split where it can report on it."""

    def __init__(self, layout: Layout, options: DataOptions):
        self.layout, self.options = layout, options
        self._tables: dict[str, Any] = {}
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

    @property
    def meta(self) -> dict[str, Any]:
        """The description (training.data.schema.describe); ConfigError names a field to fix."""
        if self._meta is None:
            self._meta = describe(self.layout.meta, self.options, lambda: self.table("train"))
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

    def split(self, name: str, spec: Any = None, *, limit: int | None = None) -> Split:
        """Arrays of split ``name`` as ``columns(spec)`` says; ``limit``: the first rows only."""
        table = self.table(name)
        if limit is not None:
            table = table.slice(0, limit)
        return to_arrays(table, self.columns(spec))


def to_arrays(table, c: Columns) -> Split:
    """``table``'s columns as the model reads them (see the module docstring)."""
    dtype = np.int64 if c.integer_features else np.float32
    cols = [_to_numpy(table.column(name)) for name in c.features]
    x = np.stack(cols, axis=1).astype(dtype) if cols else np.empty((table.num_rows, 0), dtype=dtype)
    label = c.label
    if not label:
        return Split(features=x, labels=None)
    y = _to_numpy(table.column(label))
    if c.task == "regression":
        return Split(features=x, labels=y.astype(np.float32))
    classes = c.classes
    if classes is None:
        return Split(features=x, labels=y.astype(np.int64))
    known = np.asarray(classes)
    idx = np.clip(np.searchsorted(known, y), 0, len(known) - 1)
    unknown = y[known[idx] != y]
    if len(unknown):
        raise ValueError(f"label {label!r} holds values the model does not know: {sorted(set(unknown.tolist()))[:5]} "
                         f"(its classes: {list(classes)[:20]})")
    return Split(features=x, labels=idx.astype(np.int64))


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


def _to_numpy(column) -> np.ndarray:
    """One Arrow column as a numpy array, through DLPack (no copy) where it applies: pyarrow's
    ``to_numpy`` goes through its pandas bridge, and importing pandas slows every rank's start-up
    (docs/benchmarks.md, "What changed"). Columns DLPack cannot take (nulls, other types) use ``to_numpy``."""
    try:
        if column.num_chunks:
            return np.concatenate([np.from_dlpack(chunk) for chunk in column.chunks])
    except (BufferError, TypeError, ValueError, NotImplementedError):
        pass
    return column.to_numpy(zero_copy_only=False)


