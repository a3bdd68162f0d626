"""Evaluation entry point: fetch a checkpoint from the store, verify it, score the held-out split.

    python -m training evaluate --store-uri file:///tmp/store --experiment demo --run-id RUN \
        --dataset-uri var/data/teacher

The model is rebuilt from ``model.safetensors`` + ``model_config.json`` (no pickle), after every
file of the checkpoint was checked against its manifest's sha256.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from training import checkpoint, storage
from training.data import load_split
from training.datasets import read_meta
from training.models import loss_fn, split_batch


@torch.no_grad()
def score(model: torch.nn.Module, kind: str, features: torch.Tensor, labels: torch.Tensor | None,
          batch: int = 2048) -> dict[str, float]:
    """Mean cross-entropy and accuracy; for tokens, per predicted token (next-token accuracy)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(features), batch):
        inputs, target = split_batch(kind, features[i : i + batch], labels[i : i + batch] if labels is not None else None)
        logits = model(inputs)
        loss_sum += float(loss_fn(logits, target)) * target.numel()
        correct += int((logits.argmax(dim=-1) == target).sum())
        count += target.numel()
    return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}


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
