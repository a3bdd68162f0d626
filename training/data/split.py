"""The split of one table: a row goes to validation when a 64-bit hash of its values (every
column, by name), mixed with ``split_seed``, falls below ``validation_fraction``.

A row's side depends on its own values and the seed only: appending or reordering rows never moves
an existing one, and exact duplicates always land on the same side. The share is
``validation_fraction`` in expectation, not exactly.
"""

from __future__ import annotations

import hashlib

import numpy as np


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint64(30))
        h = h * np.uint64(0xBF58476D1CE4E5B9)
        h = h ^ (h >> np.uint64(27))
        h = h * np.uint64(0x94D049BB133111EB)
        return h ^ (h >> np.uint64(31))


def _column_bits(column) -> np.ndarray:
    """A uint64 per row that depends only on the value (numbers by value: 3 and 3.0 agree)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False) + 0.0  # -0.0 -> 0.0
        bits = values.view(np.uint64).copy()
        bits[np.isnan(values)] = np.uint64(0x7FF8000000000001)  # null and every NaN alike
        return bits
    import pandas as pd

    # Anything else (strings, times, nested values): pandas' stable hash of the text form.
    return pd.util.hash_array(np.asarray(column.to_pandas().astype(str), dtype=object))


def validation_rows(table, fraction: float, seed: int) -> np.ndarray:
    """The one-table split: True for the rows that go to validation (see the module's docstring)."""
    h = np.zeros(table.num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for name in sorted(table.column_names):
            salt = np.uint64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
            h = _mix(h * _GOLDEN + _mix(_column_bits(table.column(name)) ^ salt))
        u = _mix(h ^ _mix(np.array([seed], dtype=np.uint64) + _GOLDEN))
    return (u >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction
