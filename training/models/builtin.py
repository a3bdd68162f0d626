"""The built-in model families: ``mlp`` (tables), ``cnn`` (images), ``transformer`` (tokens)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
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

    @property
    def fsdp_units(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Small image classifier (8x8 digits): two conv blocks, then an MLP head."""

    def __init__(self, *, image_shape: list[int], n_classes: int, hidden: int = 128, scale: float = 1.0):
        super().__init__()
        c, h, w = image_shape
        self.image_shape, self.scale = tuple(image_shape), scale
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * (h // 2) * (w // 2), hidden), nn.GELU(),
                                  nn.Linear(hidden, n_classes))

    @property
    def fsdp_units(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], *self.image_shape) / self.scale
        return self.head(self.features(x))


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nn.Module):
    """Small GPT-style decoder over token sequences."""

    def __init__(self, *, vocab_size: int, seq_len: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layers))

    @property
    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
