"""Typed configuration for every stage.

One ``@dataclass(kw_only=True)`` per concern. Each field carries a docstring-like comment in
``FIELD_HELP`` so the CLI and the docs can show it. User mistakes raise ``ValueError`` whose
message names the field and says how to fix it; nothing here touches the file system, starts a
process group or imports torch, so a bad config is refused before any compute is spent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODELS = ("mlp", "cnn", "transformer")
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
COMM_HOOKS = ("none", "fp16", "bf16")
TARGET_METRICS = ("eval/accuracy", "eval/loss")
# Which dataset kind (dataset.json "kind") each model reads.
MODEL_KIND = {"mlp": "tabular", "cnn": "images", "transformer": "tokens"}
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ConfigError(ValueError):
    """A configuration value a user must fix. The message names the field."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field = field_name
        super().__init__(f"config field '{field_name}': {problem}. Fix: {fix}")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything `python -m training train` needs. Field help lives in FIELD_HELP."""

    model: str = "mlp"
    strategy: str = "ddp"
    precision: str = "fp32"
    comm_hook: str = "none"
    dataset_uri: str = ""
    steps: int = 300
    batch_size: int = 64
    grad_accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 20
    seed: int = 1234
    hidden: int = 128
    depth: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    checkpoint_dir: str = ""
    checkpoint_every: int = 100
    async_checkpoint: bool = False
    output_dir: str = ""
    log_every: int = 10
    eval_every: int = 0
    target_metric: str = ""
    target_value: float = 0.0
    replica_check_every: int = 0
    collective_timeout_s: int = 300
    preempt_grace_s: int = 60

    def __post_init__(self) -> None:
        _one_of("model", self.model, MODELS)
        _one_of("strategy", self.strategy, STRATEGIES)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("comm_hook", self.comm_hook, COMM_HOOKS)
        if self.comm_hook != "none" and self.strategy != "ddp":
            raise ConfigError("comm_hook", f"{self.comm_hook!r} compresses DDP gradients but strategy is {self.strategy!r}",
                              "use comm_hook=none with fsdp (set its reduce precision through precision=bf16)")
        if self.precision == "fp16" and self.strategy == "fsdp":
            raise ConfigError("precision", "fp16 with fsdp is not supported (loss scaling of sharded gradients)",
                              "use precision=bf16 with fsdp, or strategy=ddp for fp16")
        if not self.dataset_uri:
            raise ConfigError("dataset_uri", "is empty", "pass the dataset folder, e.g. --set dataset_uri=var/data/teacher")
        for name in ("steps", "batch_size", "grad_accum", "hidden", "depth", "n_heads", "log_every", "collective_timeout_s",
                     "preempt_grace_s"):
            _positive_int(name, getattr(self, name))
        for name in ("checkpoint_every", "replica_check_every", "warmup_steps", "eval_every"):
            _non_negative_int(name, getattr(self, name))
        if self.target_metric:
            _one_of("target_metric", self.target_metric, TARGET_METRICS)
            if not self.eval_every:
                raise ConfigError("target_metric", f"{self.target_metric} is measured by evaluation during training, "
                                  "which is off (eval_every=0)", "set eval_every to a number of steps, e.g. 50")
            if not isinstance(self.target_value, (int, float)) or isinstance(self.target_value, bool) or (
                    self.target_metric.endswith("accuracy") and not 0.0 < float(self.target_value) <= 1.0):
                raise ConfigError("target_value", f"{self.target_value!r} is not a reachable {self.target_metric}",
                                  "use an accuracy in (0, 1] or a loss value, e.g. 0.8")
        if not isinstance(self.lr, (int, float)) or not 0.0 < float(self.lr) < 10.0:
            raise ConfigError("lr", f"{self.lr!r} is not a learning rate in (0, 10)", "use e.g. 3e-3")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ConfigError("weight_decay", f"{self.weight_decay!r} is negative", "use 0 or a small positive value")
        if self.model == "transformer" and self.hidden % self.n_heads:
            raise ConfigError("n_heads", f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}",
                              "choose n_heads dividing hidden (the transformer's width)")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"{self.dropout!r} is not in [0, 1)", "use e.g. 0.0 or 0.1")
        if not isinstance(self.async_checkpoint, bool):
            raise ConfigError("async_checkpoint", f"{self.async_checkpoint!r} is not true/false", "use true or false")
        if not isinstance(self.grad_clip, (int, float)) or self.grad_clip < 0:
            raise ConfigError("grad_clip", f"{self.grad_clip!r} is negative", "use 0 (off) or a positive norm such as 1.0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError("seed", f"{self.seed!r} is not a non-negative integer", "use e.g. 1234")

    def check_world_size(self, world_size: int) -> None:
        """Cross-field rule that needs the launch size: the global batch splits evenly into
        ``world_size`` ranks times ``grad_accum`` micro-batches."""
        if self.batch_size % (world_size * self.grad_accum):
            raise ConfigError(
                "batch_size",
                f"{self.batch_size} is not divisible by world_size={world_size} x grad_accum={self.grad_accum}",
                f"choose a batch_size that is a multiple of {world_size * self.grad_accum}",
            )

    def check_dataset(self, meta: dict[str, Any]) -> None:
        """The model must read the kind of data the dataset holds."""
        if MODEL_KIND[self.model] != meta.get("kind"):
            raise ConfigError("model", f"{self.model} reads {MODEL_KIND[self.model]} data but {self.dataset_uri} holds "
                              f"{meta.get('kind')} data", f"use a {MODEL_KIND[self.model]} dataset or another model")

    def check_device(self, cuda: bool) -> None:
        """Rules that depend on the hardware the ranks run on."""
        if self.comm_hook == "bf16" and not cuda:
            raise ConfigError("comm_hook", "bf16 gradient compression needs CUDA (gloo has no bf16 all-reduce)",
                              "use comm_hook=fp16 on CPU, or run on GPUs")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of what determines the trained weights (not where files go)."""
        # Evaluation during training reads the weights but never changes them.
        skip = ("checkpoint_dir", "output_dir", "eval_every", "target_metric", "target_value")
        keep = {k: v for k, v in self.to_dict().items() if k not in skip}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


FIELD_HELP = {
    "model": "model family: mlp (tabular), cnn (images), transformer (token sequences)",
    "strategy": "ddp: replicas + bucketed all-reduce overlapped with backward; fsdp: FSDP2 fully_shard per block",
    "precision": "fp32; bf16 (autocast, or FSDP2 mixed precision); fp16 (autocast + dynamic loss scaling, ddp only)",
    "comm_hook": "DDP gradient compression: none, fp16, bf16 (bf16 needs CUDA)",
    "dataset_uri": "dataset folder written by `make-data` (train/, validation/, dataset.json)",
    "steps": "optimizer steps to run in total",
    "batch_size": "global batch size (samples per optimizer step over all ranks and micro-batches)",
    "grad_accum": "micro-batches per optimizer step; only the last one communicates",
    "lr": "peak learning rate of AdamW",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the global gradient norm to this value (0 = no clipping)",
    "warmup_steps": "linear warm-up steps before cosine decay",
    "seed": "seed for weights, data order and every RNG",
    "hidden": "hidden width (mlp, cnn head) or model width d_model (transformer)",
    "depth": "hidden layers (mlp) or decoder blocks (transformer)",
    "n_heads": "attention heads (transformer)",
    "dropout": "dropout probability (transformer)",
    "checkpoint_dir": "local folder for periodic checkpoints (step_XXXXXXXX/ sub-folders)",
    "checkpoint_every": "save a checkpoint every K steps (0 = only at the end)",
    "async_checkpoint": "save periodic checkpoints with dcp.async_save (training blocks only for the copy)",
    "output_dir": "folder for the run summary (train_summary.json)",
    "log_every": "log metrics and a progress line every N steps",
    "eval_every": "score the validation split every N steps during training: eval/loss, eval/accuracy (0 = off)",
    "target_metric": "eval/accuracy or eval/loss: log time_to_target_s and steps_to_target when first reached ('' = none)",
    "target_value": "the value target_metric must reach (accuracy at least, loss at most)",
    "replica_check_every": "every N steps, compare a hash of the weights across ranks and fail on divergence (0 = off)",
    "collective_timeout_s": "timeout of one collective; a hung rank fails the run after this long",
    "preempt_grace_s": "after SIGTERM, seconds a rank may take to checkpoint and exit before it exits anyway",
}
assert set(FIELD_HELP) == {f.name for f in dataclasses.fields(TrainConfig)}


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, f"{value!r} is not supported", f"use one of {', '.join(allowed)}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(name, f"{value!r} is not a positive integer", f"set {name} to an integer >= 1")


def _non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(name, f"{value!r} is not a non-negative integer", f"set {name} to an integer >= 0")


def _coerce(f: dataclasses.Field, raw: str) -> Any:
    """Turn a `--set key=value` string into the field's type."""
    typ = f.type if isinstance(f.type, str) else f.type.__name__
    try:
        if typ == "int":
            return int(raw)
        if typ == "float":
            return float(raw)
        if typ == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
    except ValueError:
        raise ConfigError(f.name, f"{raw!r} is not a valid {typ}", f"pass a {typ} value") from None
    return raw


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a TrainConfig from an optional JSON file and `key=value` overrides."""
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if path:
        try:
            values.update(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConfigError("--config", f"file {path} does not exist", "pass an existing JSON file") from None
        except json.JSONDecodeError as e:
            raise ConfigError("--config", f"{path} is not valid JSON ({e})", "fix the JSON syntax") from None
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError("--set", f"{item!r} has no '='", "write --set key=value")
        if key not in fields:
            raise ConfigError(key, "is not a known field", f"use one of {', '.join(sorted(fields))}")
        values[key] = _coerce(fields[key], raw)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(unknown[0], "is not a known field", f"use one of {', '.join(sorted(fields))}")
    return TrainConfig(**values)


def check_path_part(name: str, value: str) -> str:
    """Refuse a value that would escape or confuse a storage key (``..``, ``/``, odd characters)."""
    if not isinstance(value, str) or not _RUN_ID_RE.match(value) or ".." in value:
        raise ConfigError(
            name,
            f"{value!r} is not a safe name",
            "use letters, digits, '.', '_' and '-' only (no '..', no '/'), at most 128 characters",
        )
    return value
