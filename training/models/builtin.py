"""The built-in model families: ``mlp`` (tables), ``cnn`` (images), ``transformer`` (a decoder over token ids:
your text through a tokenizer, or the Markov generator's tokens)."""

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


def rotary_angles(head_dim: int, positions: int | torch.Tensor, like: torch.Tensor,
                  base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (RoPE): the cosines and sines by which queries and keys are
    rotated, pairwise over the head dimension, per position (``positions``: how many, 0 on; or
    each row's positions, [batch, n]). Computed per forward (a few thousand numbers): no buffer in
    the model's state, nothing cached across calls."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=like.device, dtype=torch.float32) / head_dim)
    if isinstance(positions, torch.Tensor):
        angles = positions.to(torch.float32)[..., None] * inv_freq
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)
    angles = torch.outer(torch.arange(positions, device=like.device, dtype=torch.float32), inv_freq)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ([batch, heads, positions, head_dim]) rotated by position."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm decoder block: RMSNorm, causal scaled-dot-product attention with rotary positions,
    RMSNorm, a SwiGLU MLP; both with residual connections."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.attn_norm = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(d_model)
        hidden = 64 * math.ceil(8 * d_model / 3 / 64)  # SwiGLU's usual 8/3 width, rounded up to 64
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: [batch, 1, 1, positions], the keys to attend to (an encoder over padded
        documents); without it, causal attention (a decoder)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.drop(self.down(F.silu(gate) * up))


class Transformer(nn.Module):
    """A decoder-only language model over token ids: embedding, ``n_layers`` blocks (RMSNorm,
    rotary positions, SwiGLU, causal attention), a final RMSNorm and the output projection."""

    def __init__(self, *, vocab_size: int, seq_len: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.head_dim = d_model // n_heads
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # residual projections scaled down with depth (GPT-2)
            if name.endswith(("proj.weight", "down.weight")):
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

    def init_module(self, name: str, m: nn.Module) -> None:
        """The constructor's initialisation of one module (``name`` inside the model), for weights
        materialised after sharding (training.models.materialize)."""
        self._init(m)
        if isinstance(m, nn.RMSNorm):
            m.reset_parameters()
        if name.endswith((".proj", ".down")):
            nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * len(self.blocks)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        keep = None
        if idx.dim() == 3:  # packed SFT examples: ids and positions (training/data/sft.py)
            idx, positions = idx[:, 0], idx[:, 1]
            x = self.tok(idx)
            cos, sin = rotary_angles(self.head_dim, positions, x)
            cos, sin = cos[:, None], sin[:, None]  # [batch, 1, positions, head_dim / 2]: per row
            # A token attends to the earlier tokens of its own example only (block-diagonal causal).
            seg = torch.cumsum((positions == 0).to(torch.int64), dim=-1)
            t = idx.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
            keep = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
        else:
            x = self.tok(idx)
            cos, sin = rotary_angles(self.head_dim, idx.shape[1], x)
        for block in self.blocks:
            x = block(x, cos, sin, keep)
        return self.head(self.norm(x))


class TextClassifier(nn.Module):
    """The same blocks as an encoder over a padded document (every token attends to every
    non-padding token), its non-padding positions averaged, then a linear head over the classes."""

    def __init__(self, *, vocab_size: int, n_classes: int, pad_id: int, d_model: int = 64, n_layers: int = 2,
                 n_heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.pad_id, self.head_dim = pad_id, d_model // n_heads
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)
        self.apply(Transformer._init)

    @property
    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def init_module(self, _name: str, m: nn.Module) -> None:
        """The constructor's initialisation of one module (see ``Transformer.init_module``)."""
        Transformer._init(m)
        if isinstance(m, nn.RMSNorm):
            m.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        real = idx != self.pad_id  # [batch, positions]
        real = real | ~real.any(dim=1, keepdim=True)  # an empty document attends to its padding
        x = self.tok(idx)
        cos, sin = rotary_angles(self.head_dim, idx.shape[1], x)
        keep = real[:, None, None, :]
        for block in self.blocks:
            x = block(x, cos, sin, keep)
        x = self.norm(x)
        weights = real.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1)
        return self.head(pooled)
