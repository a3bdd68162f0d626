"""How a table becomes training data: ``DataOptions`` (label, features or the text column, task,
the split of one table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataOptions:
    """How a table becomes training data: the label, the features (or the text column), the task,
    and the split of a one-table layout. The fields of the same names in ``TrainConfig``
    (``DataOptions.of(cfg)``)."""

    label_column: str = "label"
    feature_columns: tuple[str, ...] | None = None  # None: every numeric column but the label
    task: str = "auto"
    validation_fraction: float = 0.2
    split_seed: int = 0
    text_column: str = ""  # set: the data is text (documents, or token ids as list<int>)

    @classmethod
    def of(cls, cfg: Any) -> "DataOptions":
        return cls(label_column=cfg.label_column, feature_columns=parse_columns(cfg.feature_columns), task=cfg.task,
                   validation_fraction=cfg.validation_fraction, split_seed=cfg.split_seed,
                   text_column=getattr(cfg, "text_column", "") or "")


def parse_columns(value: str | None) -> tuple[str, ...] | None:
    """``feature_columns`` as written in a Param: comma-separated names; empty means all."""
    names = tuple(c.strip() for c in (value or "").split(",") if c.strip())
    return names or None
