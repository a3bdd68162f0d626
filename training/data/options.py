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
    # set: supervised fine-tuning examples ({"prompt_column", "response_column"} or {"messages_column"})
    sft: tuple[tuple[str, str], ...] | None = None

    @property
    def is_text(self) -> bool:
        return bool(self.text_column) or self.sft is not None

    @classmethod
    def of(cls, cfg: Any) -> "DataOptions":
        return cls(label_column=cfg.label_column, feature_columns=parse_columns(cfg.feature_columns), task=cfg.task,
                   validation_fraction=cfg.validation_fraction, split_seed=cfg.split_seed,
                   text_column=getattr(cfg, "text_column", "") or "", sft=_sft_of(cfg))


SFT_FIELDS = ("prompt_column", "response_column", "messages_column")


def _sft_of(cfg: Any) -> tuple[tuple[str, str], ...] | None:
    from training.config.train_config import sft_columns

    sft = sft_columns(*(getattr(cfg, f, None) for f in SFT_FIELDS))
    return tuple(sorted(sft.items())) if sft else None


def parse_columns(value: str | None) -> tuple[str, ...] | None:
    """``feature_columns`` as written in a Param: comma-separated names; empty means all."""
    names = tuple(c.strip() for c in (value or "").split(",") if c.strip())
    return names or None
