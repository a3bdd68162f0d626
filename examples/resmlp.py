"""A residual MLP for tables: your own model, trained by the pipeline like a built-in one.

    PYTHONPATH=examples python -m training train --set model=resmlp:residual_mlp \
        --set 'model_args={"width": 64, "blocks": 2}' --set dataset_uri=... --set checkpoint_dir=...

The pipeline calls ``residual_mlp(spec)`` with the model spec: ``in_features`` and ``n_classes``
(1 output for regression) come from the data, ``model_args`` from you. Features arrive
standardized and a regression output is scaled back to the label's units outside this module.
``fsdp_units`` names the blocks FSDP shards one by one (without it, each direct child that holds
parameters is one).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Block(nn.Module):
    """x + MLP(LayerNorm(x)): the skip path keeps deep stacks trainable."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout),
                                  nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.body(x)


class ResidualMLP(nn.Module):
    def __init__(self, in_features: int, n_outputs: int, *, width: int = 64, blocks: int = 2, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*(Block(width, dropout) for _ in range(blocks)))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, n_outputs))
        self.fsdp_units = ["stem", *(f"blocks.{i}" for i in range(blocks)), "head"]

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def residual_mlp(spec: dict[str, Any]) -> nn.Module:
    args = spec.get("model_args", {})
    return ResidualMLP(spec["in_features"], spec["n_classes"], width=int(args.get("width", 64)),
                       blocks=int(args.get("blocks", 2)), dropout=float(args.get("dropout", 0.0)))
