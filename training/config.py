"""The trainer's configuration: one dataclass, each field declared once with ``knob()``.

Its title, help, type (``Literal`` for fixed choices), limits and default live under the field;
the CLI's help, ``--set`` parsing, the Airflow trigger form, the MLflow params and the tables in
docs/configuration.md and the README are all generated from it (``training.fields``). Adding a
knob means adding a field here and using it where it matters, nothing else.

Rules *between* fields are ``check_*`` functions below; every mistake raises ``ConfigError`` whose
message names the field and says how to fix it. Nothing here touches the file system, starts a
process group or imports torch, so a bad config is refused before any compute is spent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from training.fields import ConfigError, check_fields, choices, from_strings, knob

__all__ = ["ConfigError", "TrainConfig", "MODEL_KIND", "load_train_config", "check_path_part", "choices"]

# Which dataset kind (dataset.json "kind") each model reads.
MODEL_KIND = {"mlp": "tabular", "cnn": "images", "transformer": "tokens"}
ADVANCED = "Trainer (advanced)"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything `python -m training train` needs."""

    dataset_uri: str = knob(
        "", "dataset folder: train/ and validation/ Parquet splits and dataset.json (python -m training make-data "
        "writes one); on the Airflow side relative to the project folder", title="Dataset")
    model: Literal["mlp", "cnn", "transformer"] = knob(
        "mlp", "model family, matching the dataset kind: mlp (tabular, make-data --kind teacher), cnn (8x8 images, "
        "--kind digits), transformer (tokens, --kind markov)", title="Model", tag=True)
    strategy: Literal["ddp", "fsdp"] = knob(
        "ddp", "ddp: a replica per rank, bucketed all-reduce overlapped with backward; fsdp: FSDP2 fully_shard per "
        "block (parameters, gradients and optimizer state sharded)", title="Strategy", tag=True)
    precision: Literal["fp32", "bf16", "fp16"] = knob(
        "fp32", "fp32; bf16 (autocast, or FSDP2 mixed precision); fp16 (autocast + dynamic loss scaling, ddp only)",
        title="Precision", tag=True)
    comm_hook: Literal["none", "fp16", "bf16"] = knob(
        "none", "DDP gradient compression before the all-reduce: none, fp16, bf16 (bf16 needs GPUs)",
        title="Gradient compression (DDP)")
    steps: int = knob(300, "optimizer steps in total", title="Steps", minimum=1, maximum=10_000_000)
    batch_size: int = knob(
        64, "global batch: samples per optimizer step over all ranks and micro-batches; divisible by world size x "
        "grad_accum", title="Global batch size", minimum=1, maximum=1_048_576)
    grad_accum: int = knob(
        1, "micro-batches per optimizer step; only the last one communicates", title="Gradient accumulation",
        minimum=1, maximum=1024)
    lr: float = knob(3e-3, "peak AdamW learning rate (linear warm-up, cosine decay to 10%)", title="Learning rate",
                     exclusive_minimum=0, maximum=10)
    seed: int = knob(1234, "seed for weights, data order and every RNG; the same seed reproduces the run",
                     title="Seed", minimum=0)
    checkpoint_every: int = knob(
        100, "save a checkpoint every K steps (0 = only the final one); a retried train task resumes from the latest",
        title="Checkpoint every K steps", minimum=0)
    eval_every: int = knob(
        0, "score the validation split every N steps during training: eval/loss and eval/accuracy curves (0 = off; "
        "the evaluate task still scores the final checkpoint)", title="Evaluate every N steps", minimum=0,
        maximum=10_000_000)
    target_metric: Literal["none", "eval/accuracy", "eval/loss"] = knob(
        "none", "time-to-train: log time_to_target_s and steps_to_target the first time this metric reaches "
        "target_value (none = no target); needs eval_every > 0", title="Target metric")
    target_value: float | None = knob(
        None, "accuracy at least this (0-1], or loss at most this; required with a target metric",
        title="Target value", minimum=0)

    weight_decay: float = knob(0.0, "AdamW weight decay", minimum=0, maximum=10, section=ADVANCED)
    grad_clip: float = knob(1.0, "clip the global gradient norm to this value (0 = no clipping)",
                            title="Gradient clipping", minimum=0, section=ADVANCED)
    warmup_steps: int = knob(20, "linear warm-up steps before the cosine decay", title="Warm-up steps", minimum=0,
                             section=ADVANCED)
    hidden: int = knob(128, "hidden width (mlp, cnn head) or model width d_model (transformer)", title="Hidden width",
                       minimum=1, maximum=65_536, section=ADVANCED)
    depth: int = knob(2, "hidden layers (mlp) or decoder blocks (transformer)", title="Depth", minimum=1, maximum=256,
                      section=ADVANCED)
    n_heads: int = knob(4, "attention heads (transformer); must divide hidden", title="Attention heads", minimum=1,
                        maximum=256, section=ADVANCED)
    dropout: float = knob(0.0, "dropout probability (transformer)", title="Dropout", minimum=0, maximum=0.95,
                          section=ADVANCED)
    bucket_cap_mb: float = knob(
        25.0, "DDP gradient bucket size in MiB: gradients are all-reduced bucket by bucket while backward still runs, "
        "so smaller buckets overlap more communication with compute (more, smaller collectives)",
        title="DDP bucket size (MiB)", exclusive_minimum=0, maximum=1024, section=ADVANCED)
    async_checkpoint: bool = knob(
        False, "save periodic checkpoints with dcp.async_save: training blocks only while the state is copied to "
        "host memory; writing, hashing, uploading and the commit run in the background", title="Asynchronous checkpoints",
        section=ADVANCED)
    retention_keep_last: int = knob(
        3, "keep the last K committed checkpoints of the run, plus the best by eval/loss and whatever `latest` names "
        "(never deleted); applied after every commit (in the store, once the newer one is durable) and after the "
        "evaluate task; 0 keeps all", title="Keep last K checkpoints", minimum=0, maximum=1000, section=ADVANCED)
    log_every: int = knob(10, "log metrics and a progress line every N steps", title="Log every N steps", minimum=1,
                          maximum=1_000_000, section=ADVANCED)
    replica_check_every: int = knob(
        0, "every N steps compare a hash of the weights across ranks and fail on divergence (0 = off)",
        title="Replica check every N steps", minimum=0, section=ADVANCED)
    collective_timeout_s: int = knob(
        300, "timeout of one collective: a hung rank fails the run after this long", title="Collective timeout (s)",
        minimum=1, maximum=86_400, section=ADVANCED)
    preempt_grace_s: int = knob(
        60, "after SIGTERM, seconds a rank may take to checkpoint and exit before it exits anyway",
        title="Preemption grace (s)", minimum=1, maximum=3600, section=ADVANCED)

    checkpoint_dir: str = knob(
        "", "where every rank writes and commits checkpoints: a folder, file:///folder or s3://bucket/prefix "
        "(step_XXXXXXXX/ with a sha256 manifest, then `latest`); resume reads it back from there", form=False)
    output_dir: str = knob("", "folder for the run's records: steps.jsonl, train_summary.json, run_clock.json",
                           form=False)

    def __post_init__(self) -> None:
        if self.target_metric == "":  # train_config.json files written before "none" was a choice
            self.target_metric = "none"
        check_fields(self)
        check_rules(self)

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

    @property
    def has_target(self) -> bool:
        return self.target_metric != "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of what determines the trained weights (not where files go)."""
        # Evaluation during training reads the weights but never changes them.
        skip = ("checkpoint_dir", "output_dir", "eval_every", "target_metric", "target_value", "retention_keep_last")
        keep = {k: v for k, v in self.to_dict().items() if k not in skip}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def check_rules(cfg: TrainConfig) -> None:
    """Rules between fields (each field's own type and limits are checked by ``check_fields``)."""
    if cfg.comm_hook != "none" and cfg.strategy != "ddp":
        raise ConfigError("comm_hook", f"{cfg.comm_hook!r} compresses DDP gradients but strategy is {cfg.strategy!r}",
                          "use comm_hook=none with fsdp (set its reduce precision through precision=bf16)")
    if cfg.precision == "fp16" and cfg.strategy == "fsdp":
        raise ConfigError("precision", "fp16 with fsdp is not supported (loss scaling of sharded gradients)",
                          "use precision=bf16 with fsdp, or strategy=ddp for fp16")
    if not cfg.dataset_uri:
        raise ConfigError("dataset_uri", "is empty", "pass the dataset folder, e.g. --set dataset_uri=var/data/teacher")
    if cfg.has_target:
        if not cfg.eval_every:
            raise ConfigError("target_metric", f"{cfg.target_metric} is measured by evaluation during training, "
                              "which is off (eval_every=0)", "set eval_every to a number of steps, e.g. 50")
        if cfg.target_value is None:
            raise ConfigError("target_value", f"is empty but target_metric is {cfg.target_metric}",
                              "give the value to reach, e.g. 0.8 for eval/accuracy, or set target_metric to none")
        if cfg.target_metric.endswith("accuracy") and not 0.0 < cfg.target_value <= 1.0:
            raise ConfigError("target_value", f"{cfg.target_value!r} is not a reachable {cfg.target_metric}",
                              "use an accuracy in (0, 1], e.g. 0.8")
    if cfg.model == "transformer" and cfg.hidden % cfg.n_heads:
        raise ConfigError("n_heads", f"hidden={cfg.hidden} is not divisible by n_heads={cfg.n_heads}",
                          "choose n_heads dividing hidden (the transformer's width)")


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a TrainConfig from an optional JSON file and `key=value` overrides."""
    values: dict[str, Any] = {}
    if path:
        try:
            values.update(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConfigError("--config", f"file {path} does not exist", "pass an existing JSON file") from None
        except json.JSONDecodeError as e:
            raise ConfigError("--config", f"{path} is not valid JSON ({e})", "fix the JSON syntax") from None
    return TrainConfig(**from_strings(TrainConfig, values, overrides or []))


def check_path_part(name: str, value: str) -> str:
    """Refuse a value that would escape or confuse a storage key (``..``, ``/``, odd characters)."""
    if not isinstance(value, str) or not _RUN_ID_RE.match(value) or ".." in value:
        raise ConfigError(
            name,
            f"{value!r} is not a safe name",
            "use letters, digits, '.', '_' and '-' only (no '..', no '/'), at most 128 characters",
        )
    return value
