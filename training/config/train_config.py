"""The trainer's configuration: one dataclass (``TrainConfig``), each field declared once with
``knob()`` (title, help, type, limits and default live under the field); the CLI's help, ``--set``
parsing, the Airflow trigger form, the MLflow params and the tables in docs/configuration.md and
the README are generated from it (training/config/fields.py). Adding a knob means adding a field
here and using it where it matters, nothing else.

Rules *between* fields are ``check_*`` functions below; every mistake raises ``ConfigError`` whose
message names the field and says how to fix it. Nothing here touches the file system, starts a
process group or imports torch, so a bad config is refused before any compute is spent.

It is one module on purpose, however long: the fields and the rules between them are one contract
(the form, the CLI and the docs are generated from it), read and reviewed in one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from training.config.fields import ConfigError, check_fields, choices, from_strings, knob

__all__ = ["ConfigError", "TrainConfig", "MODEL_KIND", "load_train_config", "check_path_part", "choices",
           "higher_is_better", "metric_task", "check_target_task"]

# Which dataset kind (dataset.json "kind") each built-in model reads; a factory reads any.
MODEL_KIND = {"mlp": "tabular", "cnn": "images", "transformer": "tokens"}
# A built-in family, or a factory `package.module:function` (the module part may be one name).
MODEL_PATTERN = r"^(mlp|cnn|transformer|hf:.+|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$"
ADVANCED = "Trainer (advanced)"
TEXT = "Text"
ADAPT = "Adapt a model"
LORA_TARGETS_PATTERN = r"^([A-Za-z0-9_]+(,[A-Za-z0-9_]+)*|all-linear)?$"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
EVAL_METRICS = ("eval/accuracy", "eval/loss", "eval/r2", "eval/rmse")


def higher_is_better(metric: str) -> bool:
    """Accuracy and R² improve upwards; a loss and an RMSE downwards."""
    return metric in ("eval/accuracy", "eval/r2")


def metric_task(metric: str) -> str | None:
    """The task that logs ``metric`` (None: every task logs it)."""
    return {"eval/accuracy": "classification", "eval/r2": "regression", "eval/rmse": "regression",
            "eval/perplexity": "language_modeling", "eval/bits_per_byte": "language_modeling"}.get(metric)


# What each task's evaluation logs besides eval/loss (which every task logs): the fix of a mismatch.
TASK_METRICS = {"classification": "eval/accuracy", "regression": "eval/r2 or eval/rmse",
                "language_modeling": "eval/bits_per_byte or eval/perplexity"}


def check_target_task(target_metric: str, *, task: str = "auto", text_column: str | None = None,
                      data_task: str | None = None) -> None:
    """The target metric must be one the run's task logs: ``data_task`` when the data's task is
    known, else as far as the fields tell (text is a language model or a text classifier, a table of
    numbers a classifier or a regressor, ``task`` when it is not auto). Raises ``ConfigError`` on
    ``target_metric`` before any data is read or rank started."""
    wanted = metric_task(target_metric)
    if wanted is None:
        return
    if data_task is not None:
        possible, why = {data_task}, f"the data trains {data_task.replace('_', ' ')}"
    elif text_column:
        possible = {"classification"} if task == "classification" else {"classification", "language_modeling"}
        why = (f"text_column is {text_column!r}: a language model, or a text classifier when the table also "
               "holds label_column")
    elif task in ("classification", "regression"):
        possible, why = {task}, f"task is {task}"
    else:
        possible, why = {"classification", "regression"}, "text_column is empty: a table of numbers"
    if wanted not in possible:
        metrics = " / ".join(TASK_METRICS[t] for t in sorted(possible))
        raise ConfigError("target_metric", f"{target_metric} is measured for {wanted.replace('_', ' ')} only, but {why}",
                          f"use {metrics} (or eval/loss, which every task logs), or target_metric=none")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything `python -m training train` needs."""

    dataset_uri: str = knob(
        "", "Parquet data: a folder, one file, or s3://bucket/prefix (S3 settings as for the store). Layouts: train/ "
        "and validation/ (or val/) sub-folders, train* and val* files side by side, or one table split by "
        "validation_fraction; a dataset.json is optional. On the Airflow side a relative path is relative to the "
        "project folder", title="Dataset")
    label_column: str = knob(
        "label", "the column to predict (a table without dataset.json; with one, dataset.json names it)",
        title="Label column", schema={"minLength": 1})
    feature_columns: str | None = knob(
        None, "comma-separated columns the model reads; empty: every numeric column but the label (a non-numeric "
        "column named here is refused before any rank starts)", title="Feature columns")
    task: Literal["auto", "classification", "regression"] = knob(
        "auto", "auto: a label of class names, or of integers with at most 50 distinct values in train, is "
        "classification, any other numeric label regression (the run records which and why)", title="Task", tag=True)
    text_column: str | None = knob(
        None, "the column of documents (strings, or token ids as list<int>): the data is text and the model a language "
        "model, or a classifier when the table also holds label_column; empty: a table of numbers",
        title="Text column", section=TEXT)
    tokenizer: str | None = knob(
        None, "how text becomes tokens: the path or s3:// URI of a tokenizer.json (Hugging Face tokenizers), bpe:N (a "
        "byte-level BPE of N tokens trained on the train split, kept with the run and the model) or bytes (one "
        "token per byte); empty: bytes", title="Tokenizer", section=TEXT,
        schema={"examples": ["bpe:4096", "bytes"]})
    seq_len: int = knob(128, "tokens per training sequence (text)", title="Sequence length", minimum=2,
                        maximum=1_048_576, section=TEXT)
    validation_fraction: float = knob(
        0.2, "share of a one-table dataset's rows that go to validation: a hash of each row's values and split_seed "
        "decides, so appended rows never move existing ones; unused when the data has its own validation split",
        title="Validation fraction", exclusive_minimum=0, maximum=0.9)
    model: str = knob(
        "mlp", "a built-in family matching the data (mlp: tables, cnn: 8x8 images, transformer: text and tokens), "
        "hf:<folder or s3:// prefix> (a Hugging Face checkpoint folder as save_pretrained writes it: fine-tuned from "
        "its weights, or from random weights with config.json alone; never downloaded), or your own factory "
        "package.module:function, importable on the workers and in the pods: it gets the model spec (a dict) and "
        "returns a torch.nn.Module", title="Model", tag=True,
        schema={"examples": list(MODEL_KIND), "pattern": MODEL_PATTERN})
    model_args: dict[str, Any] = knob(
        {}, "a JSON object handed to a factory model untouched, as spec['model_args'] (and recorded with the model)",
        title="Model arguments")
    adapter: Literal["none", "lora"] = knob(
        "none", "an hf: model's weights stay frozen and low-rank adapters train beside them (LoRA through peft); "
        "a classifier's new head trains too. The export holds the adapter folder (PeftModel.from_pretrained on the "
        "base), with the base's path and sha256, and the merged model (from_pretrained) unless merge_adapter=false",
        title="Adapter", tag=True, section=ADAPT)
    lora_r: int = knob(8, "LoRA rank: the inner width of each adapter (trainable parameters grow with it)",
                       title="LoRA rank", minimum=1, maximum=4096, section=ADAPT)
    lora_alpha: float = knob(16.0, "LoRA scaling numerator: an adapter's update is scaled by lora_alpha / lora_r",
                             title="LoRA alpha", exclusive_minimum=0, maximum=1e6, section=ADAPT)
    lora_dropout: float = knob(0.0, "dropout on the adapters' input while training", title="LoRA dropout", minimum=0,
                               maximum=0.95, section=ADAPT)
    lora_targets: str | None = knob(
        None, "comma-separated names of the modules that get adapters (e.g. q_proj,k_proj,v_proj,o_proj), or all-linear; "
        "empty: peft's default for the architecture (Llama/Qwen/Mistral: q_proj,v_proj; GPT-2: c_attn; BERT: "
        "query,value)", title="LoRA target modules", pattern=LORA_TARGETS_PATTERN, section=ADAPT)
    merge_adapter: bool = knob(
        True, "with an adapter: the export also holds the merged model (the base's size again, loaded by "
        "from_pretrained alone); false: the adapter folder only, evaluated and registered on the base read from its "
        "folder, whose sha256 must still be the one trained on", title="Export the merged model", section=ADAPT)
    prompt_column: str | None = knob(
        None, "supervised fine-tuning: the column of prompts (strings); with response_column, each row is a prompt and "
        "its answer, the loss falls on the answer's tokens only, and examples are packed into seq_len windows "
        "without attending across them", title="Prompt column", section=ADAPT)
    response_column: str | None = knob(
        None, "supervised fine-tuning: the column of answers to prompt_column's prompts", title="Response column",
        section=ADAPT)
    messages_column: str | None = knob(
        None, "supervised fine-tuning on conversations: the column of lists of {role, content} (roles system, user, "
        "assistant, tool), rendered with the chat template; the loss falls on the assistant turns",
        title="Messages column", section=ADAPT)
    chat_template: str | None = knob(
        None, "how examples become text: the path of a Jinja chat template; none: prompt + response + end-of-text "
        "as plain text; empty: the hf: model's own template (tokenizer_config.json), else plain text",
        title="Chat template", section=ADAPT)
    max_truncated_share: float = knob(
        0.05, "supervised fine-tuning: the largest share of examples longer than seq_len + 1 tokens (cut to it) the "
        "tokenize step accepts", title="Largest share of examples cut", minimum=0, maximum=1, section=ADAPT)
    strategy: Literal["ddp", "fsdp"] = knob(
        "ddp", "ddp: a replica per rank, bucketed all-reduce overlapped with backward; fsdp: FSDP2 fully_shard per "
        "block (parameters, gradients and optimizer state sharded)", title="Strategy", tag=True)
    dp_replicate: int = knob(
        1, "fsdp: data-parallel replicas, each of dp_shard ranks (HSDP: shards within a group of consecutive ranks, "
        "one node's, and gradients all-reduced across the groups); 1: plain FSDP over every rank; -1: world size / "
        "dp_shard", title="Replicas (HSDP)", minimum=-1, maximum=65_536, section=ADVANCED)
    dp_shard: int = knob(
        -1, "fsdp: ranks one copy of the model is sharded over; -1: world size / dp_replicate (every rank with "
        "dp_replicate=1)", title="Shard group size (HSDP)", minimum=-1, maximum=65_536, section=ADVANCED)
    precision: Literal["fp32", "bf16", "fp16"] = knob(
        "fp32", "fp32; bf16 (autocast, or FSDP2 mixed precision); fp16 (autocast + dynamic loss scaling, ddp only)",
        title="Precision", tag=True)
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = knob(
        "none", "DDP gradient compression before the all-reduce: none, fp16, bf16 (bf16 needs GPUs), powersgd "
        "(low-rank, with error feedback; see powersgd_rank)", title="Gradient compression (DDP)")
    powersgd_rank: int = knob(
        4, "comm_hook=powersgd: rank of each weight matrix's gradient approximation; an n x m matrix sends "
        "(n + m) x rank numbers instead of n x m (matrices that would not shrink 2x are sent whole)",
        title="PowerSGD rank", minimum=1, maximum=1024, section=ADVANCED)
    powersgd_warmup_steps: int = knob(
        10, "comm_hook=powersgd: optimizer steps of plain all-reduce before compression starts (torch's advice: "
        "about a tenth of training, at least the LR warm-up); at least 2, DDP settles its buckets in the first step",
        title="PowerSGD warm-up steps", minimum=2, maximum=10_000_000, section=ADVANCED)
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
    target_metric: Literal["none", "eval/accuracy", "eval/loss", "eval/r2", "eval/rmse", "eval/bits_per_byte"] = knob(
        "none", "time-to-train: log time_to_target_s and steps_to_target the first time this metric reaches "
        "target_value (none = no target; accuracy for classification, r2 and rmse for regression); needs "
        "eval_every > 0", title="Target metric")
    target_value: float | None = knob(
        None, "accuracy or R² at least this (at most 1), loss or RMSE at most this; required with a target metric",
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
    activation_checkpointing: Literal["none", "full", "selective"] = knob(
        "none", "recompute activations in backward instead of keeping them, per block (transformer, hf: and factory "
        "models with fsdp_units): full = every block, selective = every second one; same gradients, less memory, "
        "about a third more compute for full", title="Activation checkpointing", section=ADVANCED)
    compile: Literal["none", "blocks"] = knob(
        "none", "torch.compile each block (transformer, hf: and factory models with fsdp_units), after activation "
        "checkpointing and before sharding: the first steps compile (perf/compile_s, apart from step time), later "
        "steps may run faster; on CPU it needs a C++ compiler", title="torch.compile", section=ADVANCED)
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
    shuffle_window: int = knob(
        16, "MiB of training rows shuffled together (blocks of about 1 MiB of token windows; a table's whole row "
        "groups, at least one): a rank holds this window and reads the next ahead, so its memory stays about "
        "2 x shuffle_window MiB whatever the data's size; the blocks are permuted each epoch, the rows in a window "
        "shuffled (larger: closer to a full shuffle)",
        title="Shuffle window (MiB)", minimum=1, maximum=65_536, section=ADVANCED)
    metrics_port: int = knob(
        9400, "each rank serves Prometheus metrics on this port + its local rank (0 = none); a port another "
        "process holds: a free port instead, named in a warning", title="Metrics port", minimum=0, maximum=65_000,
        section=ADVANCED)
    metrics_host: str = knob(
        "127.0.0.1", "address the ranks' metrics listen on (the pods listen on their pod IP)", title="Metrics address",
        pattern=r"^[A-Za-z0-9.:\-\[\]$()_]+$", section=ADVANCED)
    stall_after_s: float = knob(
        300.0, "the stall alert's floor: a run is stalled after max(this, 10 typical steps) without a step",
        title="Stalled after (s)", exclusive_minimum=0, maximum=86_400, section=ADVANCED)
    split_seed: int = knob(0, "seed of the one-table split (validation_fraction); the same seed keeps the same rows "
                           "in validation", title="Split seed", minimum=0, section=ADVANCED)

    checkpoint_dir: str = knob(
        "", "where every rank writes and commits checkpoints: a folder, file:///folder or s3://bucket/prefix "
        "(step_XXXXXXXX/ with a sha256 manifest, then `latest`); resume reads it back from there", form=False,
        per_run=True)
    output_dir: str = knob("", "folder for the run's records: steps.jsonl, train_summary.json, run_clock.json, "
                           "train.log", form=False, per_run=True)
    token_shards: str = knob(
        "", "the token windows the tokenize step made of a text dataset (a folder or s3:// prefix with a manifest): "
        "the ranks read them instead of dataset_uri", form=False, per_run=True)
    dataset_fingerprint: str = knob(
        "", "the data fingerprint the data gate recorded: the ranks refuse data whose files hash differently "
        "(empty: no check)", form=False, per_run=True)

    def __post_init__(self) -> None:
        if self.target_metric == "":  # train_config.json files written before "none" was a choice
            self.target_metric = "none"
        check_fields(self)
        check_rules(self)

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) on ``world_size`` ranks, a -1 filled in from the other: the data-parallel
        mesh, rows of consecutive ranks (a node's) sharing one sharded copy. Raises ``ConfigError`` naming
        the field when the degrees do not multiply to the world size."""
        rep, shard = self.dp_replicate, self.dp_shard
        if rep == -1 and shard == -1:
            raise ConfigError("dp_replicate", "is -1 and so is dp_shard", "set one of them to a number of ranks; -1 fills in the other")
        if rep == -1 or shard == -1:
            known, field = (shard, "dp_shard") if rep == -1 else (rep, "dp_replicate")
            if world_size % known:
                raise ConfigError(field, f"{known} does not divide world_size={world_size}",
                                  f"choose a divisor of {world_size}, e.g. {_divisor_near(world_size, known)}")
            rep, shard = (world_size // known, known) if rep == -1 else (known, world_size // known)
        if rep * shard != world_size:
            raise ConfigError("dp_shard", f"dp_replicate={rep} x dp_shard={shard} is {rep * shard}, not world_size="
                              f"{world_size}", f"make their product {world_size}, or set dp_shard=-1 to fill it in")
        return rep, shard

    def check_world_size(self, world_size: int) -> None:
        """Cross-field rules that need the launch size: the data-parallel degrees multiply to it
        (``mesh_shape``), and the global batch splits evenly into ``world_size`` ranks times
        ``grad_accum`` micro-batches."""
        self.mesh_shape(world_size)
        if self.batch_size % (world_size * self.grad_accum):
            raise ConfigError(
                "batch_size",
                f"{self.batch_size} is not divisible by world_size={world_size} x grad_accum={self.grad_accum}",
                f"choose a batch_size that is a multiple of {world_size * self.grad_accum}",
            )

    def check_dataset(self, meta: dict[str, Any]) -> None:
        """The model must read the kind of data the dataset holds (a factory reads any), and the
        target metric must be one the dataset's task logs."""
        kind = "tokens" if self.model.startswith("hf:") else MODEL_KIND.get(self.model)
        if kind == "tokens" and meta.get("kind") == "text":  # text reaches the model as token ids
            kind = "text"
        if kind is not None and kind != meta.get("kind"):
            raise ConfigError("model", f"{self.model} reads {kind} data but {self.dataset_uri} holds "
                              f"{meta.get('kind')} data", f"use a {kind} dataset or another model")
        check_target_task(self.target_metric, data_task=meta.get("task", "classification"))

    def check_device(self, cuda: bool) -> None:
        """Rules that depend on the hardware the ranks run on."""
        if self.compile != "none" and not cuda and not compiler_found():
            raise ConfigError("compile", "torch.compile on CPU generates C++ and no C++ compiler was found (CXX, "
                              "c++, g++, clang++)", "use compile=none, or install one (Debian: apt-get install g++)")
        if self.comm_hook == "bf16" and not cuda:
            raise ConfigError("comm_hook", "bf16 gradient compression needs CUDA (gloo has no bf16 all-reduce)",
                              "use comm_hook=fp16 on CPU, or run on GPUs")

    def adapter_spec(self) -> dict[str, Any] | None:
        """The adapter the model is built with (``ModelSpec.arch["adapter"]``), None without one."""
        if self.adapter == "none":
            return None
        names = self.lora_targets or ""
        targets = [t for t in names.split(",") if t] if names != "all-linear" else "all-linear"
        return {"type": self.adapter, "r": self.lora_r, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "targets": targets or None, "merge": self.merge_adapter}

    def sft_spec(self) -> dict[str, str] | None:
        """The columns supervised fine-tuning reads (``DataOptions.sft``), None without them."""
        return sft_columns(self.prompt_column, self.response_column, self.messages_column)

    @property
    def is_text(self) -> bool:
        """Text data, trained from the token windows the tokenize step makes: documents or SFT examples."""
        return bool(self.text_column) or self.sft_spec() is not None

    @property
    def has_target(self) -> bool:
        return self.target_metric != "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def weight_settings(self) -> dict[str, Any]:
        """The fields that determine the trained weights (not where files go): what ``config_hash``
        hashes and a checkpoint's manifest records, so that a resume names what changed."""
        # Evaluation during training reads the weights but never changes them.
        skip = ("checkpoint_dir", "output_dir", "eval_every", "target_metric", "target_value", "dataset_fingerprint",
                "retention_keep_last", "token_shards", "metrics_port", "metrics_host", "stall_after_s", "merge_adapter")
        return {k: v for k, v in self.to_dict().items() if k not in skip}

    def config_hash(self) -> str:
        """What a run's MLflow tag and each checkpoint's manifest say the weights were trained under."""
        return settings_hash(self.weight_settings())


def settings_hash(settings: dict[str, Any]) -> str:
    """``config_hash``: the hash of a run's ``weight_settings``."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def compiler_found() -> bool:
    """Whether inductor's CPU backend finds a C++ compiler (it tries ``CXX``, then these)."""
    import shutil

    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


def check_rules(cfg: TrainConfig) -> None:
    """Rules between fields (each field's own type and limits are checked by ``check_fields``)."""
    if cfg.comm_hook != "none" and cfg.strategy != "ddp":
        raise ConfigError("comm_hook", f"{cfg.comm_hook!r} compresses DDP gradients but strategy is {cfg.strategy!r}",
                          "use comm_hook=none with fsdp (set its reduce precision through precision=bf16)")
    for name in ("dp_replicate", "dp_shard"):
        if getattr(cfg, name) == 0:
            raise ConfigError(name, "is 0", "use a number of ranks, or -1 to fill it in from the world size")
    if cfg.strategy == "ddp" and (cfg.dp_replicate, cfg.dp_shard) != (1, -1):
        raise ConfigError("dp_replicate" if cfg.dp_replicate != 1 else "dp_shard",
                          f"dp_replicate={cfg.dp_replicate}, dp_shard={cfg.dp_shard} shape FSDP's mesh but strategy is "
                          "ddp (a whole replica on every rank)", "use strategy=fsdp for HSDP, or leave dp_replicate=1 "
                          "and dp_shard=-1")
    if cfg.adapter != "none" and not cfg.model.startswith("hf:"):
        raise ConfigError("adapter", f"{cfg.adapter} adapts a pretrained Hugging Face model, but model is {cfg.model!r}",
                          "use model=hf:<folder with config.json and model.safetensors>, or adapter=none to train "
                          "every weight")
    if not cfg.merge_adapter and cfg.adapter == "none":
        raise ConfigError("merge_adapter", "false exports an adapter without its merged model, but adapter is none",
                          "use adapter=lora, or leave merge_adapter=true")
    if cfg.precision == "fp16" and cfg.strategy == "fsdp":
        raise ConfigError("precision", "fp16 with fsdp is not supported (loss scaling of sharded gradients)",
                          "use precision=bf16 with fsdp, or strategy=ddp for fp16")
    if not cfg.dataset_uri:
        raise ConfigError("dataset_uri", "is empty", "pass the dataset folder, e.g. --set dataset_uri=var/data/teacher")
    if not re.match(MODEL_PATTERN, cfg.model):
        raise ConfigError("model", f"{cfg.model!r} is neither a built-in family ({', '.join(MODEL_KIND)}), hf:<folder> "
                          "nor a factory path package.module:function", f"use one of {', '.join(MODEL_KIND)}, or write the path of "
                          "your function, e.g. my_models.resnet:build")
    if not cfg.label_column.strip():
        raise ConfigError("label_column", "is empty", "name the column to predict, e.g. --set label_column=target")
    if cfg.has_target:
        if not cfg.eval_every:
            raise ConfigError("target_metric", f"{cfg.target_metric} is measured by evaluation during training, "
                              "which is off (eval_every=0)", "set eval_every to a number of steps, e.g. 50")
        if cfg.target_value is None:
            raise ConfigError("target_value", f"is empty but target_metric is {cfg.target_metric}",
                              "give the value to reach, e.g. 0.8 for eval/accuracy, or set target_metric to none")
        if cfg.target_metric in ("eval/accuracy", "eval/r2") and not 0.0 < cfg.target_value <= 1.0:
            raise ConfigError("target_value", f"{cfg.target_value!r} is not a reachable {cfg.target_metric}",
                              "use a value in (0, 1], e.g. 0.8")
        check_target_task(cfg.target_metric, task=cfg.task, text_column=cfg.text_column,
                          data_task="language_modeling" if cfg.sft_spec() else None)
    check_sft(cfg)
    if cfg.is_text:
        check_tokenizer(cfg.tokenizer or "")
    elif cfg.tokenizer:
        raise ConfigError("tokenizer", f"{cfg.tokenizer!r} tokenizes text, but text_column is empty",
                          "name the column of documents in text_column, or leave tokenizer empty for a table")
    if cfg.activation_checkpointing != "none" and cfg.model in ("mlp", "cnn"):
        raise ConfigError("activation_checkpointing", f"{cfg.model} has no blocks whose activations could be recomputed",
                          "use activation_checkpointing=none, or model=transformer or an hf: model")
    if cfg.compile != "none" and cfg.model in ("mlp", "cnn"):
        raise ConfigError("compile", f"{cfg.model} has no blocks to compile one by one",
                          "use compile=none, or model=transformer or an hf: model")
    if cfg.model == "transformer" and cfg.hidden % cfg.n_heads:
        raise ConfigError("n_heads", f"hidden={cfg.hidden} is not divisible by n_heads={cfg.n_heads}",
                          "choose n_heads dividing hidden (the transformer's width)")


def sft_columns(prompt: str | None, response: str | None, messages: str | None) -> dict[str, str] | None:
    """The columns supervised fine-tuning reads: conversations, or a prompt and its response; None
    without them (``TrainConfig`` refuses a half pair or both kinds)."""
    if messages:
        return {"messages_column": messages}
    if prompt or response:
        return {"prompt_column": prompt or "", "response_column": response or ""}
    return None


def check_sft(cfg: TrainConfig) -> None:
    """Supervised fine-tuning's columns: a prompt with its response, or conversations; not beside documents."""
    if cfg.messages_column and (cfg.prompt_column or cfg.response_column):
        field = "prompt_column" if cfg.prompt_column else "response_column"
        raise ConfigError(field, "is set beside messages_column: an example is a prompt and a response, or a "
                          "conversation", f"leave {field} empty, or messages_column")
    for one, other in (("prompt_column", "response_column"), ("response_column", "prompt_column")):
        if getattr(cfg, one) and not getattr(cfg, other):
            raise ConfigError(other, f"is empty but {one} is {getattr(cfg, one)!r}: an example is a prompt and its "
                              "answer", f"name the column of {other.split('_')[0]}s in {other}")
    if cfg.sft_spec() is None:
        if cfg.chat_template:
            raise ConfigError("chat_template", "renders SFT examples, but neither prompt_column nor messages_column "
                              "is set", "name the prompt and response columns, or the messages column")
        return
    if cfg.text_column:
        raise ConfigError("text_column", f"is {cfg.text_column!r} beside supervised fine-tuning's columns: documents "
                          "train on every token, examples on their answers", "leave text_column empty for SFT, or the "
                          "prompt/response/messages columns for a language model on documents")
    if cfg.task not in ("auto", "language_modeling"):
        raise ConfigError("task", f"{cfg.task} has a label, and supervised fine-tuning trains a language model on "
                          "answers", "set task=auto")


def _divisor_near(n: int, want: int) -> int:
    """The divisor of ``n`` nearest ``want`` (a fix to propose)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - want), d))


BPE_RE = re.compile(r"^bpe:(\d+)$")
MIN_BPE = 258  # the 256 bytes, the end-of-text token and at least one merge


def check_tokenizer(value: str) -> None:
    """The ``tokenizer`` field's syntax (a file's existence is checked when it is read)."""
    m = BPE_RE.match(value)
    if value.startswith("bpe:") and (m is None or int(m[1]) < MIN_BPE):
        raise ConfigError("tokenizer", f"{value!r} is not bpe:N with N >= {MIN_BPE}",
                          f"write e.g. bpe:4096 (the vocabulary size, at least {MIN_BPE}: the 256 bytes, the "
                          "end-of-text token and one merge)")


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
