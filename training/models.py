"""Model families. Plain ``nn.Module``s: parallelism is applied from outside (distributed.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MLP(nn.Module):
    """Tabular classifier: ``depth`` hidden layers of width ``hidden`` with GELU."""

    def __init__(self, *, in_features: int, n_classes: int, hidden: int = 128, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def model_spec(name: str, meta: dict[str, Any], *, hidden: int, depth: int) -> dict[str, Any]:
    """The JSON that, with the weights, rebuilds the model anywhere (``model_config.json``)."""
    if name != "mlp":
        raise ValueError(f"unknown model {name!r}")
    return {"model": "mlp", "in_features": len(meta["features"]), "n_classes": meta["n_classes"],
            "hidden": hidden, "depth": depth, "features": meta["features"]}


def build_model(spec: dict[str, Any]) -> nn.Module:
    if spec["model"] == "mlp":
        return MLP(in_features=spec["in_features"], n_classes=spec["n_classes"],
                   hidden=spec["hidden"], depth=spec["depth"])
    raise ValueError(f"unknown model {spec['model']!r} in model config")
