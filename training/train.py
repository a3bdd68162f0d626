"""The trainer: the same code by hand, under torchrun and in a Kubernetes pod.

``run(cfg)`` checks everything that can be checked (``prepare``: the data and the model, exit 2
on bad input) before a process group exists, then ``Trainer.fit`` resumes from the newest
checkpoint that verifies and trains. The loop reads as intent; each component decides whether a
step is its turn: ``Preemption`` (SIGTERM: agree on a step, checkpoint it, exit 75),
``MetricsRecorder`` (steps.jsonl, log windows, the run summary), ``Evaluator`` (eval/* and the
target), ``ReplicaCheck`` and ``Checkpointer``. Parallelism is applied from outside
(``distributed.parallel``); only rank 0 logs to MLflow. See ``python -m training train --help``.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from training import log
from training.checkpoint.manager import Checkpointer, TrainState
from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.data.dataset import Dataset, Split, open_dataset
from training.data.options import DataOptions
from training.data.sampler import ShardedSampler
from training.data.stream import NpyBlocks, StreamLoader
from training.data.table_stream import ParquetBlocks
from training.data.tokens import open_shards
from training.distributed import faults, parallel, precision
from training.distributed.launch import EXIT_PREEMPTED
from training.distributed.resilience import Phase, Preempted, Preemption, RankRecord, ReplicaCheck
from training.evaluate import Evaluator
from training.sweep import pruning as sweep_pruning
from training.metrics.memory import Estimate, tame_malloc
from training.metrics.preflight import preflight_rank
from training.metrics.recorder import MetricsRecorder
from training.metrics.startup import StartupClock
from training.metrics.steps import RunClock, StepLog, StepResult
from training.models.build import build_for_training, check_model
from training.models.loss import loss_fn, split_batch
from training.models.spec import ModelSpec
from training.store import check_writable
from training.tracking.relay import logger_for
from training.tracking.run import OnceLogger

__all__ = ["EXIT_PREEMPTED", "Preempted", "StepLog", "Trainer", "lr_lambda", "run"]


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 10% at ``steps``."""

    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def _frozen_base(spec: ModelSpec) -> Path | None:
    """The weights an adapter trains beside, which its checkpoints leave out and resume reads again."""
    if not (spec.is_hf and spec.arch.get("adapter")):
        return None
    from training.models.hf import base_weights

    return base_weights(spec)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Prepared:
    """What a run trains on, checked: the opened dataset, the model's spec, the train split's
    first rows (with its statistics and what a rank holds of it) and its blocks to stream."""

    dataset: Dataset
    spec: ModelSpec
    train: Split
    blocks: NpyBlocks | ParquetBlocks
    memory: Estimate | None = None  # this rank's estimated peak (the memory preflight)


def prepare(cfg: TrainConfig, dataset: Dataset | None = None,
            memory_check: Callable[[ModelSpec, Split], Estimate] | None = None) -> Prepared:
    """The data and the model spec, checked: the dataset opened (S3 through the local cache; data
    that changed since the gate refused), described, its train split read, the normalization
    statistics computed once from it, and the model built and run on two rows. Raises
    ConfigError naming the field to fix. ``dataset``: one already open (the Airflow pre-launch check).
    ``memory_check``: the memory preflight, after the model's check on two rows (it counts on fake tensors)."""
    if dataset is None and cfg.token_shards:  # text: the windows the tokenize step made, verified
        dataset = open_shards(cfg.token_shards)
    elif dataset is None and cfg.is_text:
        raise ConfigError("token_shards", f"text ({cfg.text_column or cfg.sft_spec()!r} of {cfg.dataset_uri}) is trained from its "
                          "token windows, and none were given", "make them first: python -m training tokenize "
                          "--dataset-uri ... --text-column ... --out DIR, then --set token_shards=<the printed URI> "
                          "(the DAG's tokenize task does this)")
    if dataset is None:
        dataset = open_dataset(cfg.dataset_uri, DataOptions.of(cfg), expect_fingerprint=cfg.dataset_fingerprint or None)
    meta = dataset.meta
    cfg.check_dataset(meta)
    # The train split streams (training/data/stream.py): only the rows the model check runs on are
    # read here, and for a table one pass, row group by row group, for its statistics.
    train, blocks = dataset.stream("train", cfg.shuffle_window)
    spec = ModelSpec.for_data(cfg.model, meta, hidden=cfg.hidden, depth=cfg.depth, n_heads=cfg.n_heads,
                              dropout=cfg.dropout, model_args=cfg.model_args, train=train,
                              adapter=cfg.adapter_spec())
    # The model first (on two rows; on the meta device under fsdp): a broken factory is named as such,
    # then the memory preflight counts the model that was checked.
    check_model(spec, train.features[:2], strategy=cfg.strategy)
    memory = memory_check(spec, train) if memory_check is not None else None
    return Prepared(dataset=dataset, spec=spec, train=train, blocks=blocks, memory=memory)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Check everything that can be checked, then train. Raises ConfigError before any process
    group exists when the config, the launch size, the hardware, the dataset or the model don't fit."""
    tame_malloc()  # before the model: a CPU rank's resident set then follows what is live
    startup = StartupClock()
    startup.mark("imports")  # the interpreter's start and the imports (torch, the trainer)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world_size(world)
    cfg.check_device(torch.cuda.is_available())
    if not cfg.checkpoint_dir:
        raise ConfigError("checkpoint_dir", "is empty", "pass a folder, file:///folder or s3://bucket/prefix")
    check_writable(cfg.checkpoint_dir, field="checkpoint_dir")  # a missing bucket or denied keys: exit 2
    # A run that cannot fit this machine's memory: exit 2, before any rank trains.
    prepared = prepare(cfg, memory_check=lambda spec, train: preflight_rank(cfg, spec, train, world))
    startup.mark("data")

    info = parallel.init(cfg.collective_timeout_s)
    startup.mark("process_group")  # includes waiting for the slowest rank to arrive
    log.init(info.rank, cfg.output_dir or None)
    try:
        return Trainer(cfg, info, prepared, startup=startup).fit()
    finally:
        parallel.cleanup()


class Trainer:
    """Builds the model, its optimizer and the components around the loop; ``fit`` trains."""

    def __init__(self, cfg: TrainConfig, info: parallel.DistInfo, prepared: Prepared,
                 startup: StartupClock | None = None) -> None:
        spec = prepared.spec
        self.cfg, self.info, self.spec = cfg, info, spec
        self.tokenizer_file = getattr(prepared.dataset, "tokenizer_file", None)  # text: exported with the model
        self.startup = startup or StartupClock()
        self.record = RankRecord(Path(cfg.output_dir) if cfg.output_dir else None, info.rank)
        self.phase = Phase(self.record, cfg.collective_timeout_s)
        _seed_everything(cfg.seed)  # same seed on every rank: identical initial weights
        # Built on the meta device; its weights are set after sharding, keyed by (seed, name).
        # Training mode explicitly: from_pretrained (a factory under ddp may load weights) can
        # return a model in eval mode, which would train with its dropout off.
        model, initial = build_for_training(spec, seed=cfg.seed, strategy=cfg.strategy)
        self.model, self.comm_timer = parallel.parallelize(model.train(), cfg, info, initial)
        # The fused AdamW kernel, one call per step instead of a Python loop over the parameters
        # (a seventh of the demo MLP's step on one CPU core). FSDP2's sharded DTensor parameters take
        # it too: 6-12% of a small decoder's FSDP step on CPU (docs/benchmarks.md).
        # Only what trains: with an adapter the frozen base has no gradients and no AdamW state.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.scaler = precision.grad_scaler(cfg.precision, info.device)
        blocks = prepared.blocks
        self.sampler = ShardedSampler(sum(blocks.sizes), global_batch=cfg.batch_size, rank=info.rank,
                                      world_size=info.world_size, seed=cfg.seed, blocks=blocks.sizes,
                                      window=blocks.window_for(cfg.shuffle_window))
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.sampler, self.scaler,
                                rank_local=parallel.rank_local_state(self.model))
        self.loader = StreamLoader(blocks, self.sampler)
        self.micro_batch = cfg.batch_size // info.world_size // cfg.grad_accum
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

        self.startup.mark("model")  # built, wrapped (DDP broadcasts rank 0's weights), optimizer
        self.mlflow = logger_for(info.is_main)
        self.startup.mark("mlflow")  # MLflow's import and connection (none when the launcher relays)
        self.metrics_log = OnceLogger(self.mlflow)  # a replayed step is not logged twice
        out = Path(cfg.output_dir) if cfg.output_dir else None
        clock = RunClock(out) if info.is_main else None  # survives restarts: run start, target hit
        self.checkpointer = Checkpointer(
            cfg.checkpoint_dir, world_size=info.world_size, settings=cfg.weight_settings(), use_async=cfg.async_checkpoint,
            every=cfg.checkpoint_every, last_step=cfg.steps, keep_last=cfg.retention_keep_last, metrics=self.metrics_log,
            mlflow=self.mlflow, phase=self.phase, frozen_base=_frozen_base(spec))
        self.recorder = MetricsRecorder(cfg, info, self.state, comm_timer=self.comm_timer, spec=spec, mlflow=self.mlflow,
                                        metrics_log=self.metrics_log, clock=clock, restarts=self.restarts, phase=self.phase)
        self.evaluator = Evaluator(cfg, info, self.model, spec, prepared.dataset, metrics_log=self.metrics_log,
                                   clock=clock, recorder=self.recorder, phase=self.phase)
        self.recorder.memory_estimate = prepared.memory
        self.evaluator.on_eval.append(self.checkpointer.note_eval)  # retention keeps the best by eval/loss
        self.replicas = ReplicaCheck(self.model, info, cfg.replica_check_every, self.phase)
        self.preemption = Preemption(cfg.preempt_grace_s, log_every=cfg.log_every, device=info.device,
                                     checkpointer=self.checkpointer, phase=self.phase)
        self.recorder.on_window.append(self.preemption.pace)
        self.checkpointer.on_commit.append(self.recorder.live.checkpoint_committed)
        faults.install(self)  # only when a TRAINING_FAULT_* variable asks for one
        self.pruning = sweep_pruning.install(self)  # a sweep's trial: the pruner may stop it at an evaluation
        self.startup.mark("components")  # checkpointer, recorder, evaluator (reads the validation split)

    def fit(self) -> dict[str, Any]:
        """Resume from the newest checkpoint that verifies (if any), train up to ``cfg.steps``,
        commit the final checkpoint with the exported model; returns the run summary."""
        wall_start = time.perf_counter()
        resumed_from, rng_restored = self.checkpointer.resume(self.state)
        self.startup.mark("resume")
        if not rng_restored:
            # Fresh start, or a checkpoint from fewer ranks: per-rank streams (dropout) derived from
            # seed, step and rank, so they differ across ranks and are reproducible.
            _seed_everything(self.cfg.seed + 1 + 1000 * self.state.step + self.info.rank)
        self.recorder.start(resumed_from)
        self.startup.mark("telemetry")  # params logged, peak FLOP/s, system metrics started
        if self.info.is_main:
            log.logger.info(self.startup.line())
            self.metrics_log.log_metrics(self.startup.metrics(), step=self.state.step)
        self.preemption.arm()
        try:
            with self.phase.names_failures(self.info, lambda: self.state.step):
                with self.phase("training"):
                    self._loop()
                with self.phase("final export"):
                    self.preemption.drain()
                    self.optimizer.zero_grad(set_to_none=True)  # not saved: room for the export's gather
                    final_uri = self.checkpointer.finalize(self.state, self.model, self.spec, self.tokenizer_file)
        finally:
            self.recorder.close()
            self.loader.close()
        return self._summary(final_uri, resumed_from, wall_start)

    def _loop(self) -> None:
        """Every component decides itself whether this step is its turn."""
        while self.state.step < self.cfg.steps and not (self.pruning and self.pruning.stop):
            self.preemption.maybe_stop(self.state)  # an agreed SIGTERM: checkpoint this step, raise Preempted
            result = self._train_step()
            self.state.step += 1
            step = self.state.step
            self.record.beat(step)
            self.recorder.record(step, result)
            self.recorder.maybe_log(step)
            self.evaluator.maybe_eval(step)
            self.replicas.maybe_check(step)
            self.checkpointer.maybe_save(self.state, step)

    def _train_step(self) -> StepResult:
        """One optimizer step over this rank's share of the global batch, in ``grad_accum``
        micro-batches of which only the last communicates."""
        cfg, info, phase, spec = self.cfg, self.info, self.phase, self.spec
        t0 = time.perf_counter()
        with phase("data"):
            x_all, y_all = self._next_batch()
        data_s = time.perf_counter() - t0

        self.optimizer.zero_grad(set_to_none=True)
        self.comm_timer.pop_step()  # collectives outside training steps (FSDP evaluation) don't count
        loss_sum = torch.zeros((), device=info.device)
        micro, exposed = self.micro_batch, None
        for m in range(cfg.grad_accum):
            last = m == cfg.grad_accum - 1
            xb = x_all[m * micro : (m + 1) * micro]
            yb = y_all[m * micro : (m + 1) * micro] if y_all is not None else None
            inputs, target = split_batch(spec.kind, xb, yb)
            with phase("forward/backward" if last else "forward/backward (accumulation, no communication)"):
                with parallel.gradient_sync(self.model, last):
                    with precision.autocast(cfg.precision, cfg.strategy, info.device):
                        loss = loss_fn(self.model(inputs), target, task=spec.task,
                                       target_var=spec.target_variance) / cfg.grad_accum
                    self.scaler.scale(loss).backward()
            if last:  # backward returned after the gradient collectives completed
                exposed = self.comm_timer.backward_done()
            loss_sum += loss.detach()

        with phase("optimizer step"):
            self.scaler.unscale_(self.optimizer)
            # Without clipping the norm is only logged: measured at log steps (the recorder).
            grad_norm = (torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                         if cfg.grad_clip > 0 else None)
            scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = scale_before is not None and self.scaler.get_scale() < scale_before
            self.scheduler.step()
        comm = self.comm_timer.pop_step()
        return StepResult(loss=loss_sum, grad_norm=grad_norm, skipped=skipped, seconds=time.perf_counter() - t0,
                          data_s=data_s, exposed=exposed, comm=comm)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's rows of the next global batch, streamed."""
        x, y = self.loader.next_batch()
        x_all, y_all = torch.from_numpy(x), (torch.from_numpy(y) if y is not None else None)
        device = self.info.device
        return x_all.to(device, non_blocking=True), (y_all.to(device, non_blocking=True) if y_all is not None else None)

    def _summary(self, final_uri: str, resumed_from: str | None, wall_start: float) -> dict[str, Any]:
        """Collective. The run summary every rank returns; rank 0 also tags the MLflow run with the
        final checkpoint and writes ``output_dir/train_summary.json``."""
        cfg, info, tel = self.cfg, self.info, self.recorder
        run_summary = tel.run_summary(self.state.step)
        summary = {
            "final_step": self.state.step,
            "checkpoint_uri": final_uri,
            "world_size": info.world_size,
            "first_logged_loss": tel.first_loss,
            "last_logged_loss": tel.last_loss,
            "resumed_from": resumed_from,
            "restarts": self.restarts,
            "skipped_steps": tel.skipped_steps,
            "train_wall_s": time.perf_counter() - wall_start,
            "config_hash": cfg.config_hash(),
            "pruned_at": self.pruning.pruned_at if self.pruning else None,
            **run_summary,
        }
        if info.is_main:
            if tel.out:
                tel.out.mkdir(parents=True, exist_ok=True)
                (tel.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.logger.info(f"train: done at step {self.state.step}; final checkpoint {final_uri}")
        return summary
