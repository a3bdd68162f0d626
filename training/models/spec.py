"""``ModelSpec``: what rebuilds a model anywhere, with the weights (``model_config.json``)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np


BUILTIN = ("mlp", "cnn", "transformer")


FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def column_stats(values: np.ndarray) -> tuple[list[float], list[float]]:
    """Mean and standard deviation per column, in float64 then float32 (a constant column gets
    std 1: it is centred, not blown up)."""
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    mean, std = v.mean(axis=0), v.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return [float(np.float32(m)) for m in mean], [float(np.float32(s)) for s in std]


def model_spec(name: str, meta: dict[str, Any], *, hidden: int, depth: int, n_heads: int = 4, dropout: float = 0.0,
               model_args: dict[str, Any] | None = None, train=None) -> dict[str, Any]:
    """The JSON that, with the weights, rebuilds the model anywhere (``model_config.json``).

    ``meta``: the dataset's description (training.schema.describe); ``train`` (training.data.Split):
    the rows the normalization statistics come from, needed when the description asks for them."""
    task = meta.get("task", "classification")
    base: dict[str, Any] = {"model": name, "kind": meta["kind"], "task": task, "features": meta["features"],
                            "label": meta.get("label"), "model_args": dict(model_args or {})}
    if meta.get("classes") is not None:
        base["classes"] = list(meta["classes"])
    if meta["kind"] == "tabular":
        base.update(in_features=len(meta["features"]), n_classes=1 if task == "regression" else int(meta["n_classes"]))
        if (meta.get("normalize") or task == "regression") and train is None:
            raise ValueError("model_spec needs the train rows to compute the normalization statistics")
        if meta.get("normalize"):
            mean, std = column_stats(train.features)
            base["normalization"] = {"mean": mean, "std": std}
        if task == "regression":
            (t_mean,), (t_std,) = column_stats(train.labels)
            base["target"] = {"mean": t_mean, "std": t_std}
    elif meta["kind"] == "images":
        base.update(image_shape=meta["image_shape"], n_classes=meta["n_classes"])
    elif meta["kind"] == "tokens":
        base.update(vocab_size=meta["vocab_size"], seq_len=meta["seq_len"], n_classes=meta["vocab_size"])
    if name == "mlp":
        return {**base, "hidden": hidden, "depth": depth}
    if name == "cnn":
        return {**base, "hidden": hidden, "scale": float(meta["feature_range"][1]) or 1.0}
    if name == "transformer":
        return {**base, "d_model": hidden, "n_layers": depth, "n_heads": n_heads, "dropout": dropout}
    if FACTORY_RE.match(name):
        return base
    raise ValueError(f"unknown model {name!r}")
