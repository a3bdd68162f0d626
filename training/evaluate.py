"""Scoring a model: one loop (``score``) for evaluation during training (``Evaluator``, sharded
over the ranks) and after it, from a checkpoint in the store (``run``):

    python -m training evaluate --store-uri file:///tmp/store --experiment demo --run-id RUN \
        --dataset-uri var/data/teacher

After training the model is rebuilt from ``model.safetensors`` + ``model_config.json`` (no
pickle), after every file of the checkpoint was checked against its manifest's sha256.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from training import checkpoint, distributed, metrics, precision, storage
from training.data import load_split
from training.datasets import read_meta
from training.log import logger
from training.models import loss_fn, split_batch


@torch.no_grad()
def score(model: torch.nn.Module, kind: str, features: torch.Tensor, labels: torch.Tensor | None,
          batch: int = 2048, *, device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1,
          autocast=contextlib.nullcontext) -> dict[str, float]:
    """Mean cross-entropy and accuracy; for tokens, per predicted token (next-token accuracy).

    With ``world_size`` > 1 (a process group is up) rank ``rank`` scores a contiguous
    1/world of the rows and the sums are all-reduced, so every rank gets the same figures. Every
    rank runs the same number of forward calls (FSDP all-gathers parameters in each one)."""
    n = len(features)
    bounds = [n * r // world_size for r in range(world_size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    n_batches = math.ceil(max(b - a for a, b in zip(bounds, bounds[1:])) / batch)
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    try:
        for b in range(n_batches):
            s, e = min(hi, lo + b * batch), min(hi, lo + (b + 1) * batch)
            inputs, target = split_batch(kind, features[s:e].to(device),
                                         labels[s:e].to(device) if labels is not None else None)
            with autocast():
                logits = model(inputs)
            if target.numel() == 0:  # this rank's share ran out; the forward still ran (FSDP)
                continue
            loss_sum += float(loss_fn(logits, target)) * target.numel()
            correct += float((logits.argmax(dim=-1) == target).sum())
            count += target.numel()
    finally:
        model.train(was_training)
    if world_size > 1:
        sums = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        loss_sum, correct, count = sums.tolist()
    return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}


class Evaluator:
    """Evaluation during training, every ``cfg.eval_every`` steps (0: never): all ranks score
    the validation split (sharded, see ``score``); rank 0 logs ``eval/*`` and, the first time the
    target is reached, ``time_to_target_s`` / ``steps_to_target`` (wall time since the run's first
    attempt started training, as MLPerf counts time-to-train: evaluation included). The time it
    takes is not training time: it is handed to ``telemetry.not_training``."""

    def __init__(self, cfg, info: distributed.DistInfo, model: torch.nn.Module, kind: str, *, metrics_log,
                 clock: metrics.RunClock | None, telemetry, phase) -> None:
        self.cfg, self.info, self.kind = cfg, info, kind
        self.every = cfg.eval_every
        self.model = distributed.for_evaluation(model)
        self.metrics_log, self.clock, self.telemetry, self.phase = metrics_log, clock, telemetry, phase
        self.on_eval: list[Callable[[int, dict[str, float]], None]] = []  # every rank, after each evaluation
        if self.every:
            val = load_split(cfg.dataset_uri, "validation")
            self.features = torch.from_numpy(val.features)
            self.labels = torch.from_numpy(val.labels) if val.labels is not None else None

    def maybe_eval(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        self.phase.now = "evaluation"
        t0 = time.perf_counter()
        self._evaluate(step)
        self.telemetry.not_training(time.perf_counter() - t0)

    def _evaluate(self, step: int) -> None:
        cfg, info = self.cfg, self.info
        res = score(self.model, self.kind, self.features, self.labels, max(256, cfg.batch_size), device=info.device,
                    rank=info.rank, world_size=info.world_size,
                    autocast=lambda: precision.autocast(cfg.precision, cfg.strategy, info.device))
        for hook in self.on_eval:
            hook(step, res)
        if not info.is_main:
            return
        self.metrics_log.log_metrics(res, step=step)
        logger.info(f"eval step {step}: loss {res['eval/loss']:.4f} | accuracy {res['eval/accuracy']:.4f}")
        if cfg.has_target and self.clock.target() is None and metrics.target_reached(
                cfg.target_metric, res[cfg.target_metric], cfg.target_value):
            hit = self.clock.reach_target(step, time.time())
            self.metrics_log.log_metrics(hit, step=step)
            logger.info(f"target {cfg.target_metric} {cfg.target_value} reached at step {step} after "
                        f"{hit['time_to_target_s']:.1f}s")


def run(*, store_uri: str, experiment: str, run_id: str, dataset_uri: str, work_dir: str | None = None,
        keep_model_in: str | None = None, store_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Score the run's latest verified checkpoint; ``keep_model_in`` also keeps its verified
    ``model.safetensors`` + ``model_config.json`` there (for the model registry)."""
    meta = read_meta(dataset_uri)
    val = load_split(dataset_uri, "validation")
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        local, manifest, warnings = storage.fetch_checkpoint(store_uri, experiment=experiment, run_id=run_id, dest=tmp,
                                                             env=store_env)
        if not (local / checkpoint.MODEL_FILE).is_file():
            raise storage.CheckpointCorrupt(f"{local.name} has no {checkpoint.MODEL_FILE}: not a final checkpoint")
        model, spec = checkpoint.load_exported(local)
        if keep_model_in:
            Path(keep_model_in).mkdir(parents=True, exist_ok=True)
            for name in (checkpoint.MODEL_FILE, checkpoint.MODEL_CONFIG_FILE):
                shutil.copyfile(local / name, Path(keep_model_in) / name)
    if spec["features"] != meta["features"]:
        raise ValueError(f"model was trained on features {spec['features']} but the dataset has {meta['features']}")
    labels = torch.from_numpy(val.labels) if val.labels is not None else None
    metrics = score(model, meta["kind"], torch.from_numpy(val.features), labels)
    return {
        **metrics,
        "step": manifest["step"],
        "checkpoint_step_dir": local.name,
        "bayes_accuracy": meta.get("bayes_accuracy"),
        "chance_accuracy": meta.get("chance_accuracy"),
        "loss_floor": meta.get("loss_floor"),
        "warnings": warnings,
        "rows": len(val.features),
    }


def score_folder(model_dir: str | Path, dataset_uri: str) -> dict[str, float]:
    """Score an exported model folder (``model.safetensors`` + ``model_config.json``) on the
    validation split of ``dataset_uri``: how the registry compares a champion on new data."""
    meta = read_meta(dataset_uri)
    model, spec = checkpoint.load_exported(model_dir)
    if spec["features"] != meta["features"]:
        raise ValueError(f"model was trained on features {spec['features']} but the dataset has {meta['features']}")
    val = load_split(dataset_uri, "validation")
    labels = torch.from_numpy(val.labels) if val.labels is not None else None
    return score(model, meta["kind"], torch.from_numpy(val.features), labels)


def example_inputs(dataset_uri: str, n: int = 5):
    """Model inputs for the first ``n`` validation rows (numpy): the logged model's input example."""
    meta = read_meta(dataset_uri)
    val = load_split(dataset_uri, "validation")
    labels = torch.from_numpy(val.labels[:n]) if val.labels is not None else None
    inputs, _ = split_batch(meta["kind"], torch.from_numpy(val.features[:n]), labels)
    return inputs.numpy()
