"""Evaluation entry point: fetch a checkpoint from the store, verify it, score the held-out split.

    python -m training evaluate --store-uri file:///tmp/store --experiment demo --run-id RUN \
        --dataset-uri var/data/teacher

The model is rebuilt from ``model.safetensors`` + ``model_config.json`` (no pickle), after every
file of the checkpoint was checked against its manifest's sha256.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from training import checkpoint, storage
from training.data import load_split
from training.datasets import read_meta


@torch.no_grad()
def score(model: torch.nn.Module, features: torch.Tensor, labels: torch.Tensor, batch: int = 4096) -> dict[str, float]:
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(labels), batch):
        logits = model(features[i : i + batch])
        loss_sum += float(F.cross_entropy(logits, labels[i : i + batch], reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels[i : i + batch]).sum())
    return {"eval/loss": loss_sum / len(labels), "eval/accuracy": correct / len(labels)}


def run(*, store_uri: str, experiment: str, run_id: str, dataset_uri: str, work_dir: str | None = None,
        store_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta = read_meta(dataset_uri)
    val = load_split(dataset_uri, "validation")
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        local, manifest, warnings = storage.fetch_checkpoint(store_uri, experiment=experiment, run_id=run_id, dest=tmp,
                                                             env=store_env)
        if not (local / checkpoint.MODEL_FILE).is_file():
            raise storage.CheckpointCorrupt(f"{local.name} has no {checkpoint.MODEL_FILE}: not a final checkpoint")
        model, spec = checkpoint.load_exported(local)
    if spec["features"] != meta["features"]:
        raise ValueError(f"model was trained on features {spec['features']} but the dataset has {meta['features']}")
    metrics = score(model, torch.from_numpy(val.features), torch.from_numpy(val.labels))
    return {
        **metrics,
        "step": manifest["step"],
        "checkpoint_step_dir": local.name,
        "bayes_accuracy": meta.get("bayes_accuracy"),
        "chance_accuracy": meta.get("chance_accuracy"),
        "warnings": warnings,
        "rows": len(val.labels),
    }
