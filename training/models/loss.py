"""What a model is trained on: a batch's input and target, and the loss of a task."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def split_batch(kind: str, x: torch.Tensor, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Model input and target for one batch: tokens predict their successor."""
    if kind == "tokens":
        return x[:, :-1], x[:, 1:]
    return x, y


def loss_fn(logits: torch.Tensor, target: torch.Tensor, *, task: str = "classification",
            target_var: float = 1.0) -> torch.Tensor:
    """Cross-entropy over classes; regression: mean squared error over the label's train variance."""
    if task == "regression":
        return F.mse_loss(logits.float().reshape(-1), target.float().reshape(-1)) / target_var
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def target_variance(spec: dict[str, Any]) -> float:
    return float(spec["target"]["std"]) ** 2 if spec.get("target") else 1.0
