"""``ModelSpec``: what, with the weights, rebuilds a model anywhere. Its JSON form is
``model_config.json`` (``to_json`` / ``from_json``), and a factory model gets that JSON as a dict.

``ModelSpec.for_data`` makes one from the dataset's description: the columns, the task, the
outputs, the normalization statistics of a table (train's mean/std per feature, and of a regression
label) and the family's sizes (``arch``: ``hidden``/``depth`` for ``mlp``, ``hidden``/``scale`` for
``cnn``, ``d_model``/``n_layers``/``n_heads``/``dropout`` for ``transformer``; none for a factory,
which reads ``model_args``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BUILTIN = ("mlp", "cnn", "transformer")
FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
# The keys of model_config.json that are fields of their own; every other key is the family's (arch).
_FIELDS = ("model", "kind", "task", "features", "label", "model_args", "classes", "in_features", "n_classes",
           "image_shape", "vocab_size", "seq_len", "normalization", "target", "tokenizer_sha256", "pad_id")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    model: str  # a built-in family (BUILTIN) or a factory path package.module:function
    kind: str  # tabular | images | tokens (a language model's windows) | text (a classifier's documents)
    task: str  # classification | regression (tokens: next-token classification)
    features: list[str]  # the columns the model reads, in order
    label: str | None  # the label column (None for tokens)
    n_classes: int  # outputs per row: classes, 1 for regression, the vocabulary for tokens
    model_args: dict[str, Any] = field(default_factory=dict)  # the user's, untouched
    classes: list[Any] | None = None  # the label values, when they are not 0..C-1
    in_features: int | None = None  # tabular
    image_shape: list[int] | None = None  # images: [channels, height, width]
    vocab_size: int | None = None  # tokens
    seq_len: int | None = None  # tokens: positions the model reads (a row holds seq_len + 1)
    normalization: dict[str, list[float]] | None = None  # tabular: {"mean": [...], "std": [...]} per feature
    target: dict[str, float] | None = None  # regression: {"mean", "std"} of the train label
    tokenizer_sha256: str | None = None  # text: the tokenizer whose ids the model reads (tokenizer.json beside it)
    pad_id: int | None = None  # text classification: the id that pads a short document (not attended to)
    arch: dict[str, Any] = field(default_factory=dict)  # the built-in family's sizes
    # A model_config.json written before the spec named its label and task: the dataset's description says.
    label_from_data: bool = False

    @property
    def is_factory(self) -> bool:
        return self.model not in BUILTIN and not self.is_hf

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    @property
    def target_variance(self) -> float:
        """The train label's variance (regression losses are in its units); 1 otherwise."""
        return float(self.target["std"]) ** 2 if self.target else 1.0

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The output of one row (a batch adds a leading dimension), after the table's transform."""
        if self.kind == "tokens":
            return (self.seq_len, self.vocab_size)
        if self.kind == "text":
            return (self.n_classes,)
        return () if self.task == "regression" else (self.n_classes,)

    @classmethod
    def for_data(cls, model: str, meta: dict[str, Any], *, hidden: int, depth: int, n_heads: int = 4,
                 dropout: float = 0.0, model_args: dict[str, Any] | None = None, train: Any = None,
                 adapter: dict[str, Any] | None = None) -> "ModelSpec":
        """The spec of ``model`` on data described by ``meta`` (training.data.schema.describe);
        ``train`` (a training.data.dataset.Split): the rows the normalization statistics come from;
        ``adapter``: an hf model's adapter (``TrainConfig.adapter_spec``), kept in ``arch``."""
        hf = model.startswith("hf:")
        if model not in BUILTIN and not FACTORY_RE.match(model) and not hf:
            raise ValueError(f"unknown model {model!r}")
        kind, task = meta["kind"], meta.get("task", "classification")
        out: dict[str, Any] = {"model": model, "kind": kind, "task": task, "features": list(meta["features"]),
                               "label": meta.get("label"), "model_args": dict(model_args or {})}
        if meta.get("classes") is not None:
            out["classes"] = list(meta["classes"])
        if kind == "tabular":
            out.update(in_features=len(meta["features"]), n_classes=1 if task == "regression" else int(meta["n_classes"]))
            if (meta.get("normalize") or task == "regression") and train is None:
                raise ValueError("ModelSpec.for_data needs the train rows to compute the normalization statistics")
            # A streamed split's statistics come with its first rows (one pass over the whole split).
            stats = getattr(train, "stats", None) or {}
            if meta.get("normalize"):
                mean, std = stats_lists(*stats["features"]) if "features" in stats else column_stats(train.features)
                out["normalization"] = {"mean": mean, "std": std}
            if task == "regression":
                (t_mean,), (t_std,) = stats_lists(*stats["labels"]) if "labels" in stats else column_stats(train.labels)
                out["target"] = {"mean": t_mean, "std": t_std}
        elif kind == "images":
            out.update(image_shape=list(meta["image_shape"]), n_classes=int(meta["n_classes"]))
        elif kind == "tokens":
            out.update(vocab_size=int(meta["vocab_size"]), seq_len=int(meta["seq_len"]), n_classes=int(meta["vocab_size"]))
            if meta.get("tokenizer_sha256"):
                out["tokenizer_sha256"] = meta["tokenizer_sha256"]
        elif kind == "text":
            out.update(vocab_size=int(meta["vocab_size"]), seq_len=int(meta["seq_len"]), n_classes=int(meta["n_classes"]),
                       pad_id=int(meta["pad_id"]), tokenizer_sha256=meta.get("tokenizer_sha256"))
        if model == "mlp":
            out["arch"] = {"hidden": hidden, "depth": depth}
        elif model == "cnn":
            out["arch"] = {"hidden": hidden, "scale": float(meta["feature_range"][1]) or 1.0}
        elif model == "transformer":
            out["arch"] = {"d_model": hidden, "n_layers": depth, "n_heads": n_heads, "dropout": dropout}
        elif hf:  # the folder's config.json, adapted to the task (num_labels, padding)
            from training.models.hf import check_vocabulary, hf_config

            out["arch"] = hf_config(model, task=task, n_classes=out.get("n_classes", 0), pad_id=out.get("pad_id"),
                                    classes=out.get("classes"), adapter=adapter)
            check_vocabulary(model, out["arch"], int(meta.get("tokenizer_vocab") or meta["vocab_size"]))
        return cls(**out)

    def to_json(self) -> dict[str, Any]:
        """``model_config.json``: one flat object, the family's sizes beside the other keys."""
        out: dict[str, Any] = {"model": self.model, "kind": self.kind, "task": self.task, "features": list(self.features),
                               "label": self.label, "model_args": dict(self.model_args)}
        if self.classes is not None:
            out["classes"] = list(self.classes)
        for key in ("in_features", "image_shape", "vocab_size", "seq_len"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["n_classes"] = self.n_classes
        for key in ("normalization", "target", "tokenizer_sha256", "pad_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return {**out, **self.arch}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelSpec":
        """A spec read back from ``model_config.json`` (of this version or an earlier one)."""
        known = {k: d[k] for k in _FIELDS if k in d}
        known.setdefault("model_args", {})
        legacy = "label" not in d or "task" not in d
        known.setdefault("label", None)
        known.setdefault("task", "classification")
        if "n_classes" not in known and d.get("kind") == "tokens":
            known["n_classes"] = d["vocab_size"]
        return cls(**known, arch={k: v for k, v in d.items() if k not in _FIELDS}, label_from_data=legacy)


def column_stats(values: np.ndarray) -> tuple[list[float], list[float]]:
    """Mean and standard deviation per column, in float64 then float32 (a constant column gets
    std 1: it is centred, not blown up)."""
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    return stats_lists(v.mean(axis=0), v.std(axis=0))


def stats_lists(mean: np.ndarray, std: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-column mean and standard deviation (float64) as the spec keeps them: float32 values, a
    constant column's std 1."""
    std = np.where(std > 0, std, 1.0)
    return [float(np.float32(m)) for m in mean], [float(np.float32(s)) for s in std]
