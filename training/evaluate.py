"""Scoring a model: one loop (``score``) for evaluation during training (``Evaluator``, sharded
over the ranks) and after it, from a checkpoint in the store (``run``). Token shards' validation
split is streamed from its blocks (``score_blocks``), never held whole; a table's is in memory:

    python -m training evaluate --store-uri file:///tmp/store --experiment demo --run-id RUN \
        --dataset-uri var/data/teacher

Classification (and tokens): ``eval/loss`` (mean cross-entropy) and ``eval/accuracy``. Regression:
``eval/loss`` (mean squared error over the train label's variance, as in training), ``eval/rmse``
(in the label's units) and ``eval/r2`` (1 - squared error / the validation label's squared
deviation from its own mean). After training the model is rebuilt from ``model.safetensors`` +
``model_config.json`` (no pickle) once every file of the checkpoint matched its manifest's sha256.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from training.checkpoint.commit import CheckpointCorrupt, fetch_checkpoint
from training.checkpoint.export import EXPORTED, MODEL_FILE, is_exported, load_exported
from training.distributed import precision
from training.distributed.parallel import DistInfo, for_evaluation
from training.metrics.formulas import bits_per_byte, target_reached
from training.metrics.steps import RunClock
from training.results import reports
from training.data.dataset import Dataset, Split, open_dataset
from training.log import logger
from training.models.generate import continue_text
from training.data.sft import IGNORE
from training.models.loss import loss_fn, split_batch
from training.models.spec import ModelSpec
from training.data.options import DataOptions
from training.data.tokens import TokenDataset, open_shards


class _Rows:
    """A split in memory (tensors), read by ranges."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor | None):
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.features)

    def take(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.features[a:b], self.labels[a:b] if self.labels is not None else None


class _BlockRows:
    """A split streamed from a blocks source (``.sizes``: rows per block; ``.read_window(ids)`` ->
    (features, labels | None) numpy arrays of those blocks' rows; ``.dtype``, if it has one: what
    features are converted to), read forward by ranges: only the blocks a range touches are read,
    and the last ones read are kept for the next range, so a reader holds one batch and a block or two."""

    def __init__(self, source: Any):
        self.source = source
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(source.sizes, dtype=np.int64))])
        self.dtype = getattr(source, "dtype", None)  # NpyBlocks: int64, for token ids kept as uint16
        self._lo = self._hi = 0
        self._x: np.ndarray | None = None
        self._y: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._x is None or not (self._lo <= a and b <= self._hi):
            first = int(np.searchsorted(self.starts, a, side="right")) - 1 if a < b else 0
            stop = int(np.searchsorted(self.starts, b, side="left")) if a < b else 0  # past the block of row b - 1
            self._x, self._y = self.source.read_window(np.arange(first, stop, dtype=np.int64))
            self._lo, self._hi = (int(self.starts[first]), int(self.starts[stop])) if a < b else (a, a)
        x = self._x[a - self._lo : b - self._lo]
        y = self._y[a - self._lo : b - self._lo] if self._y is not None else None
        x = x.astype(self.dtype) if self.dtype is not None else np.ascontiguousarray(x)
        return torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(y)) if y is not None else None


def _rows(split: Any) -> _Rows | _BlockRows:
    """A Split (training.data.dataset) in memory, or any blocks source (see ``_BlockRows``) streamed."""
    if isinstance(split, Split):
        return _Rows(torch.from_numpy(split.features),
                     torch.from_numpy(split.labels) if split.labels is not None else None)
    return _BlockRows(split)


@torch.no_grad()
def _score(model: torch.nn.Module, kind: str, rows: _Rows | _BlockRows, batch: int = 2048, *,
           device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1, autocast=contextlib.nullcontext,
           task: str = "classification", target_var: float = 1.0) -> dict[str, float]:
    n = len(rows)
    bounds = [n * r // world_size for r in range(world_size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    n_batches = math.ceil(max(b - a for a, b in zip(bounds, bounds[1:])) / batch)
    was_training = model.training
    model.eval()
    # classification: loss, correct, count; regression: squared error, count, sum y, sum y^2
    sums = torch.zeros(4, dtype=torch.float64)
    try:
        for b in range(n_batches):
            x, y = rows.take(min(hi, lo + b * batch), min(hi, lo + (b + 1) * batch))
            inputs, target = split_batch(kind, x.to(device), y.to(device) if y is not None else None)
            with autocast():
                logits = model(inputs)
            if target.numel() == 0:  # this rank's share ran out; the forward still ran (FSDP)
                continue
            if task == "regression":
                y = target.double()
                sums += torch.tensor([float(((logits.double().reshape(-1) - y) ** 2).sum()), target.numel(),
                                      float(y.sum()), float((y * y).sum())], dtype=torch.float64)
            else:
                counted = int((target != IGNORE).sum())  # SFT: the answers' tokens only
                if not counted:
                    continue
                sums += torch.tensor([float(loss_fn(logits, target)) * counted,
                                      float((logits.argmax(dim=-1) == target).sum()), counted, 0.0],
                                     dtype=torch.float64)
    finally:
        model.train(was_training)
    if world_size > 1:
        sums = sums.to(device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    a, b, c, d = sums.tolist()
    if task == "regression":
        spread = d - c * c / b  # the validation label's squared deviation from its mean
        return {"eval/loss": a / b / target_var, "eval/rmse": math.sqrt(a / b),
                "eval/r2": 1.0 - a / spread if spread > 0 else float("nan")}
    return {"eval/loss": a / c, "eval/accuracy": b / c}


def score(model: torch.nn.Module, kind: str, features: torch.Tensor, labels: torch.Tensor | None,
          batch: int = 2048, **kwargs: Any) -> dict[str, float]:
    """Classification: mean cross-entropy and accuracy (for tokens per predicted token);
    regression: loss, RMSE and R² (see the module docstring).

    With ``world_size`` > 1 (a process group is up) rank ``rank`` scores a contiguous
    1/world of the rows and the sums are all-reduced, so every rank gets the same figures. Every
    rank runs the same number of forward calls (FSDP all-gathers parameters in each one).
    Keywords: ``device``, ``rank``, ``world_size``, ``autocast``, ``task``, ``target_var``."""
    return _score(model, kind, _Rows(features, labels), batch, **kwargs)


def score_blocks(model: torch.nn.Module, kind: str, source: Any, batch: int = 2048, **kwargs: Any) -> dict[str, float]:
    """``score`` on a split streamed from a blocks source (``.sizes``, ``.read_window(ids)``; see
    ``_BlockRows``): the same rows in the same batches, so the same figures, but a rank reads only
    the blocks of its own share, a batch at a time."""
    return _score(model, kind, _BlockRows(source), batch, **kwargs)


def score_spec(model: torch.nn.Module, spec: ModelSpec, split: Any, **kwargs: Any) -> dict[str, float]:
    """``score`` a model on a split as its spec says (kind, task, target): a Split
    (training.data.dataset) in memory, or a blocks source streamed (``score_blocks``)."""
    return _score(model, spec.kind, _rows(split), task=spec.task, target_var=spec.target_variance, **kwargs)


def _batches(split: Any, batch: int = 2048) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every row of a split (in memory or streamed), ``batch`` rows at a time."""
    rows = _rows(split)
    for s in range(0, len(rows), batch):
        yield rows.take(s, min(len(rows), s + batch))


def with_lm_figures(res: dict[str, float], tokens_per_byte: float | None) -> dict[str, float]:
    """A language model's figures beside its loss: ``eval/perplexity`` and, where the text's size
    is known, ``eval/bits_per_byte`` (comparable across tokenizers)."""
    out = {**res, "eval/perplexity": math.exp(min(res["eval/loss"], 700.0))}
    bpb = bits_per_byte(res["eval/loss"], tokens_per_byte)
    if bpb is not None:
        out["eval/bits_per_byte"] = bpb
    return out


def _tokens_per_byte(dataset: Any) -> float | None:
    return dataset.tokens_per_byte() if isinstance(dataset, TokenDataset) else None


def summary_line(res: dict[str, float]) -> str:
    """``loss 0.41 | accuracy 0.83`` (or rmse/r2): the figures of one evaluation."""
    return " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in res.items())


class Evaluator:
    """Evaluation during training, every ``cfg.eval_every`` steps (0: never): all ranks score
    the validation split (sharded, see ``score``); rank 0 logs ``eval/*`` and, the first time the
    target is reached, ``time_to_target_s`` / ``steps_to_target`` (wall time since the run's first
    attempt started training, as MLPerf counts time-to-train: evaluation included). The time it
    takes is not training time: it is handed to ``recorder.not_training``."""

    def __init__(self, cfg, info: DistInfo, model: torch.nn.Module, spec: ModelSpec,
                 dataset: Dataset, *, metrics_log, clock: RunClock | None, recorder, phase) -> None:
        self.cfg, self.info, self.spec = cfg, info, spec
        self.every = cfg.eval_every
        self.model = for_evaluation(model)
        self.metrics_log, self.clock, self.recorder, self.phase = metrics_log, clock, recorder, phase
        self.on_eval: list[Callable[[int, dict[str, float]], None]] = []  # every rank, after each evaluation
        if self.every:  # token shards: a blocks source, each rank reads its share at each evaluation
            self.validation = validation_for(dataset, spec)
            self.tokens_per_byte = _tokens_per_byte(dataset)

    def maybe_eval(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        t0 = time.perf_counter()
        with self.phase("evaluation"):
            self._evaluate(step)
        self.recorder.not_training(time.perf_counter() - t0)

    def _evaluate(self, step: int) -> None:
        cfg, info = self.cfg, self.info
        res = score_spec(self.model, self.spec, self.validation, batch=max(256, cfg.batch_size), device=info.device,
                         rank=info.rank, world_size=info.world_size,
                         autocast=lambda: precision.autocast(cfg.precision, cfg.strategy, info.device))
        if self.spec.task == "language_modeling":
            res = with_lm_figures(res, self.tokens_per_byte)
        for hook in self.on_eval:
            hook(step, res)
        if not info.is_main:
            return
        self.metrics_log.log_metrics(res, step=step)
        logger.info(f"eval step {step}: {summary_line(res)}")
        if cfg.has_target and self.clock.target() is None and target_reached(
                cfg.target_metric, res[cfg.target_metric], cfg.target_value):
            hit = self.clock.reach_target(step, time.time())
            self.recorder.mlflow.log_summary(hit)  # one-off figures: the run summary, not a series
            logger.info(f"target {cfg.target_metric} {cfg.target_value} reached at step {step} after "
                        f"{hit['time_to_target_s']:.1f}s")


def run(*, store_uri: str, experiment: str, run_id: str, dataset_uri: str, work_dir: str | None = None,
        keep_model_in: str | None = None, store_env: Mapping[str, str] | None = None,
        options: DataOptions | None = None, token_shards: str | None = None) -> dict[str, Any]:
    """Score the run's latest verified checkpoint on the validation split; ``keep_model_in`` also
    keeps its verified ``model.safetensors`` + ``model_config.json`` there (for the model
    registry). ``store_env``: S3 settings, for the store and an ``s3://`` dataset alike;
    ``options``: the run's label, features and split (DataOptions); ``token_shards``: a text
    dataset's token windows (what a language model is scored on, with samples of its text)."""
    dataset = open_shards(token_shards, store_env) if token_shards else open_dataset(dataset_uri, options, env=store_env)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        local, manifest, warnings = fetch_checkpoint(store_uri, experiment=experiment, run_id=run_id, dest=tmp,
                                                             env=store_env)
        if not is_exported(local):
            raise CheckpointCorrupt(f"{local.name} has no {MODEL_FILE}: not a final checkpoint")
        model, spec = load_exported(local)
        if keep_model_in:
            for name in EXPORTED:
                if (local / name).is_file():
                    (Path(keep_model_in) / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(local / name, Path(keep_model_in) / name)
    val = validation_for(dataset, spec)
    figures = score_spec(model, spec, val)
    meta = {} if isinstance(dataset, TokenDataset) else dataset.layout.meta or {}
    samples = None
    if spec.task == "language_modeling":
        figures = with_lm_figures(figures, _tokens_per_byte(dataset))
        samples = text_samples(model, spec, dataset) if isinstance(dataset, TokenDataset) else None
    return {
        **figures,
        "samples": samples,
        "task": spec.task,
        "report": reports.evaluation_report(spec.task, spec.kind, model, _batches(val)),
        "step": manifest["step"],
        "checkpoint_step_dir": local.name,
        "bayes_accuracy": meta.get("bayes_accuracy"),
        "chance_accuracy": meta.get("chance_accuracy"),
        "loss_floor": meta.get("loss_floor"),
        "warnings": warnings,
        "rows": len(_rows(val)),
    }


def text_samples(model: torch.nn.Module, spec: ModelSpec, dataset: TokenDataset) -> dict[str, Any]:
    """The beginnings of a few validation documents, continued by the model greedily and by
    sampling with a fixed seed."""
    loaded = dataset.tokenizer()
    prompts = dataset.stats.get("prompts") or []
    sft = dataset.stats.get("sft") or {}
    # An SFT answer ends at its template's end-of-turn token (ChatML's <|im_end|>), else at end of text.
    kw = {"seq_len": spec.seq_len, "stop_id": sft.get("stop_id", loaded.eot_id)}
    out = {"prompts": prompts, "greedy": continue_text(model, loaded.tokenizer, prompts, **kw),
           "sampled": continue_text(model, loaded.tokenizer, prompts, sample=True, seed=0, **kw),
           "sampling": "top-k 40, temperature 0.8, seed 0", "tokenizer": loaded.source}
    if dataset.stats.get("answers"):
        out["answers"] = dataset.stats["answers"]
    return out


def validation_for(dataset: Dataset | TokenDataset, spec: ModelSpec):
    """The validation rows as the model reads them, a blocks source (streamed, see ``score_blocks``):
    token shards' blocks, a table's row groups; a model of other columns is refused."""
    return dataset.blocks("validation", spec)


def score_folder(model_dir: str | Path, dataset: str | Dataset | TokenDataset,
                 options: DataOptions | None = None) -> dict[str, float]:
    """Score an exported model folder (``model.safetensors`` + ``model_config.json``) on the
    validation split of a dataset: how the registry compares a champion on new data. A language
    model is scored only on windows of its own tokenizer's ids (else ValueError)."""
    ds = dataset if isinstance(dataset, (Dataset, TokenDataset)) else open_dataset(dataset, options)
    model, spec = load_exported(model_dir)
    if isinstance(ds, TokenDataset) and spec.tokenizer_sha256 != ds.meta["tokenizer_sha256"]:
        raise ValueError("the model reads another tokenizer's ids than these token windows hold")
    res = score_spec(model, spec, validation_for(ds, spec))
    return with_lm_figures(res, _tokens_per_byte(ds)) if spec.task == "language_modeling" else res


def example_inputs(dataset: str | Dataset | TokenDataset, n: int = 5, options: DataOptions | None = None):
    """Model inputs for the first ``n`` validation rows (numpy): the logged model's input example."""
    ds = dataset if isinstance(dataset, (Dataset, TokenDataset)) else open_dataset(dataset, options)
    val = ds.split("validation", limit=n)
    labels = torch.from_numpy(val.labels) if val.labels is not None else None
    inputs, _ = split_batch(ds.meta["kind"], torch.from_numpy(val.features), labels)
    return inputs.numpy()
