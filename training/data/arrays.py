"""A table's rows as the model reads them: ``Columns`` (what to read), ``Split`` (features and
labels as numpy arrays, or a streamed split's first rows with its statistics) and ``to_arrays``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


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
    # The whole split's (mean, std) per column of "features" and "labels" when these arrays are only
    # its first rows (streamed): what the normalization statistics come from (ModelSpec.for_data).
    stats: dict[str, tuple[np.ndarray, np.ndarray]] | None = None


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


