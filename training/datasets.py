"""Dataset generators with a known answer.

``teacher``: tabular classification. Features are standard normal; the label is the argmax of a
fixed random two-layer "teacher" network, then with probability ``label_noise`` replaced by a
uniformly random class. A model that recovers the teacher exactly gets

    bayes_accuracy = 1 - label_noise * (C - 1) / C

on fresh data, and no model can do better in expectation, so convergence is judged against a
number written next to the data (``dataset.json``), not against folklore.

Layout (the same for every kind, so storage and validation are generic)::

    {root}/dataset.json                 kind, schema, reachable accuracy, row counts
    {root}/train/part-00000.parquet
    {root}/validation/part-00000.parquet
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SPLITS = ("train", "validation")


def teacher_labels(x: np.ndarray, n_classes: int, seed: int) -> np.ndarray:
    """Labels from the fixed teacher network determined by ``seed`` (noise-free)."""
    rng = np.random.default_rng(seed + 10_000)
    d = x.shape[1]
    w1 = rng.normal(0.0, 1.0 / np.sqrt(d), size=(d, 32))
    w2 = rng.normal(0.0, 1.0 / np.sqrt(32), size=(32, n_classes))
    return np.argmax(np.tanh(x @ w1) @ w2, axis=1)


def make_teacher_dataset(
    root: str | Path,
    *,
    n_train: int = 20_000,
    n_val: int = 4_000,
    n_features: int = 16,
    n_classes: int = 4,
    label_noise: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the ``teacher`` dataset under ``root`` and return its ``dataset.json`` content."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if n_train <= 0 or n_val <= 0:
        raise ValueError("n_train and n_val must be positive")
    if not 0.0 <= label_noise < 1.0:
        raise ValueError("label_noise must be in [0, 1)")
    root = Path(root)
    rng = np.random.default_rng(seed)
    feature_names = [f"f{i}" for i in range(n_features)]
    counts = {"train": n_train, "validation": n_val}
    for split in SPLITS:
        n = counts[split]
        x = rng.normal(size=(n, n_features)).astype(np.float32)
        y = teacher_labels(x, n_classes, seed)
        flip = rng.random(n) < label_noise
        y = np.where(flip, rng.integers(0, n_classes, size=n), y).astype(np.int64)
        table = pa.table({**{name: x[:, i] for i, name in enumerate(feature_names)}, "label": y})
        (root / split).mkdir(parents=True, exist_ok=True)
        tmp = root / split / "part-00000.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(root / split / "part-00000.parquet")
    meta = {
        "kind": "tabular",
        "generator": "teacher",
        "seed": seed,
        "features": feature_names,
        "label": "label",
        "n_classes": n_classes,
        # 6 sigma of a standard normal: wider values mean the data is not what it claims.
        "feature_range": [-6.0, 6.0],
        "label_noise": label_noise,
        "bayes_accuracy": 1.0 - label_noise * (n_classes - 1) / n_classes,
        "chance_accuracy": 1.0 / n_classes,
        "rows": counts,
    }
    (root / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def read_meta(root: str | Path) -> dict[str, Any]:
    path = Path(root) / "dataset.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: dataset_uri must be a folder written by `python -m training make-data`"
        )
    return json.loads(path.read_text())
