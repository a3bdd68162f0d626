"""What a model is trained on: a batch's input and target (tokens predict their successor), and
the loss of its task: cross-entropy over classes, or for regression the mean squared error in units
of the train label's variance, so ``train/loss`` and ``eval/loss`` read as the share of the label's
variance left unexplained."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_batch(kind: str, x: torch.Tensor, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Model input and target for one batch: tokens predict their successor; packed SFT windows
    (tokens with labels: positions and answer marks) predict only their answers' tokens, from ids
    and positions stacked ``[batch, 2, seq_len]`` (training/data/sft.py)."""
    if kind == "tokens" and y is not None:
        from training.data.sft import model_batch

        return model_batch(x, y)
    if kind == "tokens":
        return x[:, :-1], x[:, 1:]
    return x, y


def loss_fn(logits: torch.Tensor, target: torch.Tensor, *, task: str = "classification",
            target_var: float = 1.0) -> torch.Tensor:
    """Cross-entropy over classes (targets of -100 count for nothing: an SFT prompt's tokens);
    regression: mean squared error over the label's train variance."""
    if task == "regression":
        return F.mse_loss(logits.float().reshape(-1), target.float().reshape(-1)) / target_var
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
