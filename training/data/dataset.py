"""The rows training reads: ``open_dataset`` (a dataset_uri's layout, description and splits as
arrays) and a resumable, deterministic, rank-sharded sampler.

``Dataset.split(name, spec)`` gives a split's features (float32 ``[n, d]``; int64 token sequences)
and labels (class indices for classification, mapped through the description's ``classes`` when
they are not 0..C-1; float32 targets for regression; none for tokens), the columns and classes
as the model spec (or, without one, the dataset's description) names them.

The sampler treats training data as an endless stream of epochs, each a fresh permutation
seeded by ``(seed, epoch)``. Its whole state is one integer, the global sample position ``pos``;
``(epoch, offset) = divmod(pos, n)``. Step ``s`` takes the global positions
``[s * B, (s + 1) * B)`` and rank ``r`` of ``W`` takes the ``r``-th contiguous ``B / W`` of them.
So across ranks every sample is seen exactly once per epoch, a batch may straddle an epoch
boundary instead of dropping a tail, and resuming at ``pos`` reproduces the same order exactly.
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


@dataclass
class Split:
    features: np.ndarray  # float32 [n, d] (tabular, images) or int64 [n, seq_len + 1] (tokens)
    labels: np.ndarray | None  # int64 class indices [n], float32 targets [n] (regression); None for tokens


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
        """The description (training.schema.describe); ConfigError names a field to fix."""
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

    def split(self, name: str, spec: Mapping[str, Any] | None = None, *, limit: int | None = None) -> Split:
        """Arrays of split ``name`` for the columns and classes ``spec`` (a model spec) names;
        without one, the dataset's description. ``limit``: the first rows only."""
        table = self.table(name)
        if limit is not None:
            table = table.slice(0, limit)
        return to_arrays(table, dict(self.meta) if spec is None else {**_fallback(self, spec), **spec})


def _fallback(ds: Dataset, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A model spec written before it named its label and task (make-data datasets only)."""
    if "label" in spec and "task" in spec:
        return {}
    meta = ds.meta
    return {"label": meta.get("label"), "task": meta.get("task", "classification"), "kind": meta["kind"],
            "feature_dtype": meta.get("feature_dtype", "float")}


def to_arrays(table, d: Mapping[str, Any]) -> Split:
    """``table``'s columns as the model reads them (see the module docstring)."""
    dtype = np.int64 if d.get("feature_dtype") == "int" else np.float32
    cols = [_to_numpy(table.column(c)) for c in d["features"]]
    x = np.stack(cols, axis=1).astype(dtype) if cols else np.empty((table.num_rows, 0), dtype=dtype)
    label = d.get("label")
    if not label:
        return Split(features=x, labels=None)
    y = _to_numpy(table.column(label))
    if d.get("task") == "regression":
        return Split(features=x, labels=y.astype(np.float32))
    classes = d.get("classes")
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


def load_split(root: str | Path | Dataset, split: str, spec: Mapping[str, Any] | None = None) -> Split:
    """Split ``split`` of a dataset (a Dataset, or a folder opened with the default options)."""
    ds = root if isinstance(root, Dataset) else open_dataset(root)
    return ds.split(split, spec)


def _to_numpy(column) -> np.ndarray:
    """One Arrow column as a numpy array, through DLPack (no copy) where it applies: pyarrow's
    ``to_numpy`` goes through its pandas bridge, and importing pandas is about half a second of
    every rank's start-up. Columns DLPack cannot take (nulls, other types) use ``to_numpy``."""
    try:
        if column.num_chunks:
            return np.concatenate([np.from_dlpack(chunk) for chunk in column.chunks])
    except (BufferError, TypeError, ValueError, NotImplementedError):
        pass
    return column.to_numpy(zero_copy_only=False)


