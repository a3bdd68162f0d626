"""The run's Params as the trainer's configuration (``train_config``) and as the options that
say how a table becomes training data (``data_options``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training_airflow import settings


def train_config(params: dict[str, Any], *, world_size: int | None = None, checkpoint_dir: str = "-",
                 output_dir: str = "", dataset_uri: str | None = None, dataset_fingerprint: str = "",
                 token_shards: str = "") -> Any:
    """The run's Params as a ``TrainConfig``; raises ``ConfigError`` naming the field.

    Every field of the trainer that is a Param is taken as is (a Param a deployment lacks keeps the
    trainer's default); the rules that need the launch size are checked too, and the model against
    the kind a local ``dataset.json`` declares (the data and the model themselves are checked by
    ``validate_data`` once the gate has read the data). ``dataset_fingerprint``: what the gate
    recorded, for the ranks to compare with what they read; ``token_shards``: the token windows of
    a text dataset (the tokenize task's), which the ranks read instead."""
    from training.config.train_config import TrainConfig
    from training.config.fields import specs

    values = {name: params[name] for name, spec in specs(TrainConfig).items() if spec.form and name in params}
    values["dataset_uri"] = settings.resolve_path(dataset_uri or params["dataset_uri"])
    cfg = TrainConfig(**values, checkpoint_dir=checkpoint_dir, output_dir=output_dir,
                      dataset_fingerprint=dataset_fingerprint, token_shards=token_shards)
    cfg.check_world_size(int(world_size or params["world_size"]))
    if Path(cfg.dataset_uri, "dataset.json").is_file():  # a missing dataset is the data gate's to report
        from training.data.synthetic import read_meta

        meta = read_meta(cfg.dataset_uri)
        if "kind" in meta:
            cfg.check_dataset(meta)
    elif cfg.text_column and cfg.has_target and (task := _text_task(cfg.dataset_uri, cfg.label_column, cfg.text_column)):
        from training.config.train_config import check_target_task

        check_target_task(cfg.target_metric, data_task=task)
    return cfg


def _text_task(uri: str, label: str, text_column: str) -> str | None:
    """The task of a local text table without dataset.json, from one Parquet file's schema (no rows
    read): a classifier when it holds ``label``, else a language model (the gate's rule, in
    ``training.data.schema``). None where that cannot be told cheaply (S3, no Parquet file here):
    the gate reports it."""
    import pyarrow.parquet as pq

    root = Path(uri)
    if uri.startswith("s3://") or not root.exists():
        return None
    first = root if root.is_file() else next(iter(sorted(root.rglob("*.parquet"))), None)
    try:
        names = pq.read_schema(first).names if first is not None else None
    except (OSError, ValueError):  # not readable as Parquet: the gate says why
        return None
    if names is None or text_column not in names:  # the gate names the missing column
        return None
    return "classification" if label in names and label != text_column else "language_modeling"


def data_options(params: dict[str, Any]) -> Any:
    """The run's label, features, task and split (``training.data.options.DataOptions``); a Param a
    deployment lacks keeps the trainer's default."""
    from types import SimpleNamespace

    from training.config.train_config import TrainConfig
    from training.config.fields import specs
    from training.data.options import DataOptions

    fields = specs(TrainConfig)
    names = ("label_column", "feature_columns", "task", "validation_fraction", "split_seed", "text_column",
             "prompt_column", "response_column", "messages_column")
    return DataOptions.of(SimpleNamespace(**{n: params.get(n, fields[n].default) for n in names}))
