"""Models: the built-in families and users' own, built from one JSON spec (``model_config.json``).

``model`` is a built-in family (``mlp``, ``cnn``, ``transformer``) or a factory path
``package.module:function`` importable where the model is built (the ranks, the pods, the Airflow
worker's pre-launch check, ``evaluate`` and the registry's re-scoring of a champion). The
factory gets one dict, the model spec (``model_spec``), with at least ``kind``, ``task``,
``features`` and, by kind, ``in_features`` + ``n_classes`` (tables; 1 output for regression),
``image_shape`` + ``n_classes`` (images), ``vocab_size`` + ``seq_len`` (tokens), plus the user's
``model_args`` passed through untouched, and returns an ``nn.Module`` mapping a batch to logits or
predictions. Parallelism is applied from outside (distributed.py); a module may name the sub-modules
FSDP shards one by one in an ``fsdp_units`` attribute (modules or their dotted names), else each
direct child that holds parameters is one.

Tables are standardized (``normalize``: train's mean/std per feature) and regression targets
scaled (train's mean/std of the label) by ``Tabular``, a wrapper around the model whose buffers hold
those statistics: they travel in every checkpoint and in ``model.safetensors``, and the registered
model applies them itself, so it takes raw feature values and predicts in the label's units.

``loss_fn``: cross-entropy over classes (the shifted sequence for tokens); for regression the mean
squared error in units of the train label's variance (standardized target), so ``train/loss`` and
``eval/loss`` read as the share of the label's variance left unexplained.

``check_model`` builds the model and runs two rows through it before any rank starts; a factory that
cannot be imported, raises, returns no ``nn.Module``, or gives outputs of the wrong shape for the
task is refused (``ConfigError`` naming ``model``, the factory path and the error).
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn

from training.fields import ConfigError


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


BUILTIN = ("mlp", "cnn", "transformer")
FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


class Tabular(nn.Module):
    """A tabular model with its data transform inside: features standardized with train's
    mean/std, a regression output scaled back to the label's units (``[B, 1]`` becomes ``[B]``;
    ``[B]`` is taken as it is).
    The statistics are buffers, so checkpoints and model.safetensors carry them."""

    def __init__(self, model: nn.Module, *, mean=None, std=None, target: dict[str, float] | None = None):
        super().__init__()
        self.model = model
        self.standardize = mean is not None
        if self.standardize:
            self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
            self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.regression = target is not None
        if self.regression:
            self.register_buffer("target_mean", torch.tensor(float(target["mean"]), dtype=torch.float32))
            self.register_buffer("target_std", torch.tensor(float(target["std"]), dtype=torch.float32))

    @property
    def fsdp_units(self) -> list[nn.Module]:
        return shard_units(self.model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.standardize:
            x = (x - self.mean) / self.std
        out = self.model(x)
        if self.regression:
            if out.dim() == 2 and out.shape[1] == 1:
                out = out[:, 0]
            out = out * self.target_std + self.target_mean
        return out


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules FSDP2 shards one by one: the model's ``fsdp_units`` (modules or dotted
    names), else each direct child that holds parameters."""
    units = getattr(model, "fsdp_units", None)
    if units is None:
        return [c for c in model.children() if next(c.parameters(), None) is not None]
    return [model.get_submodule(u) if isinstance(u, str) else u for u in units]


def column_stats(values: np.ndarray) -> tuple[list[float], list[float]]:
    """Mean and standard deviation per column, in float64 then float32 (a constant column gets
    std 1: it is centred, not blown up)."""
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    mean, std = v.mean(axis=0), v.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return [float(np.float32(m)) for m in mean], [float(np.float32(s)) for s in std]


def model_spec(name: str, meta: dict[str, Any], *, hidden: int, depth: int, n_heads: int = 4, dropout: float = 0.0,
               model_args: dict[str, Any] | None = None, train=None) -> dict[str, Any]:
    """The JSON that, with the weights, rebuilds the model anywhere (``model_config.json``).

    ``meta``: the dataset's description (training.schema.describe); ``train`` (training.data.Split):
    the rows the normalization statistics come from, needed when the description asks for them."""
    task = meta.get("task", "classification")
    base: dict[str, Any] = {"model": name, "kind": meta["kind"], "task": task, "features": meta["features"],
                            "label": meta.get("label"), "model_args": dict(model_args or {})}
    if meta.get("classes") is not None:
        base["classes"] = list(meta["classes"])
    if meta["kind"] == "tabular":
        base.update(in_features=len(meta["features"]), n_classes=1 if task == "regression" else int(meta["n_classes"]))
        if (meta.get("normalize") or task == "regression") and train is None:
            raise ValueError("model_spec needs the train rows to compute the normalization statistics")
        if meta.get("normalize"):
            mean, std = column_stats(train.features)
            base["normalization"] = {"mean": mean, "std": std}
        if task == "regression":
            (t_mean,), (t_std,) = column_stats(train.labels)
            base["target"] = {"mean": t_mean, "std": t_std}
    elif meta["kind"] == "images":
        base.update(image_shape=meta["image_shape"], n_classes=meta["n_classes"])
    elif meta["kind"] == "tokens":
        base.update(vocab_size=meta["vocab_size"], seq_len=meta["seq_len"], n_classes=meta["vocab_size"])
    if name == "mlp":
        return {**base, "hidden": hidden, "depth": depth}
    if name == "cnn":
        return {**base, "hidden": hidden, "scale": float(meta["feature_range"][1]) or 1.0}
    if name == "transformer":
        return {**base, "d_model": hidden, "n_layers": depth, "n_heads": n_heads, "dropout": dropout}
    if FACTORY_RE.match(name):
        return base
    raise ValueError(f"unknown model {name!r}")


def factory(path: str) -> Callable[[dict[str, Any]], nn.Module]:
    """The function ``package.module:function`` names (imported now)."""
    module_name, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"{attr} in {module_name} is a {type(fn).__name__}, not a function")
    return fn


def _build_inner(spec: dict[str, Any]) -> nn.Module:
    name = spec["model"]
    if name == "mlp":
        return MLP(in_features=spec["in_features"], n_classes=spec["n_classes"], hidden=spec["hidden"], depth=spec["depth"])
    if name == "cnn":
        return CNN(image_shape=spec["image_shape"], n_classes=spec["n_classes"], hidden=spec["hidden"], scale=spec["scale"])
    if name == "transformer":
        return Transformer(vocab_size=spec["vocab_size"], seq_len=spec["seq_len"], d_model=spec["d_model"],
                           n_layers=spec["n_layers"], n_heads=spec["n_heads"], dropout=spec["dropout"])
    if FACTORY_RE.match(str(name)):
        import copy

        model = factory(name)(copy.deepcopy(spec))  # the user's function may keep or change its dict
        if not isinstance(model, nn.Module):
            raise TypeError(f"returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    raise ValueError(f"unknown model {name!r} in model config")


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model ``spec`` describes, with the data transform of a table inside (``Tabular``)."""
    model = _build_inner(spec)
    norm, target = spec.get("normalization"), spec.get("target")
    if norm is None and target is None:
        return model
    return Tabular(model, mean=norm and norm["mean"], std=norm and norm["std"], target=target)


def expected_output(spec: dict[str, Any], batch: int) -> tuple[int, ...]:
    """The output shape of a batch, by kind and task (after ``Tabular``)."""
    if spec["kind"] == "tokens":
        return (batch, spec["seq_len"], spec["vocab_size"])
    if spec.get("task") == "regression":
        return (batch,)
    return (batch, spec["n_classes"])


def check_model(spec: dict[str, Any], example: np.ndarray, *, strategy: str = "ddp") -> None:
    """Build the model and run ``example`` (a few rows of model input) through it; ConfigError
    naming ``model`` with the factory path and the error when that fails or the output does not
    fit the task. With fsdp, every ``fsdp_units`` entry must be a sub-module of the model."""
    name = spec["model"]
    fix = ("make the factory importable where the model is built (PYTHONPATH, or the training image), return a "
           "torch.nn.Module built from the spec dict, and give one output per class (tables, images: [batch, "
           "n_classes]; regression: [batch, 1]; tokens: [batch, seq_len, vocab_size])")
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        try:
            model = build_model(spec)
        except Exception as e:
            raise ConfigError("model", f"{name}: {type(e).__name__}: {e}", fix) from None
    try:
        if strategy == "fsdp":
            inner = model.model if isinstance(model, Tabular) else model
            units = shard_units(inner)
            owned = {id(m) for m in inner.modules()} - {id(inner)}
            stray = [type(u).__name__ for u in units if id(u) not in owned]
            if stray:
                raise ValueError(f"fsdp_units must be sub-modules of the model, got {', '.join(stray)}")
        model.eval()
        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(example))
            if spec["kind"] == "tokens":
                x = x[:, :-1]
            out = model(x)
    except Exception as e:
        raise ConfigError("model", f"{name}: {type(e).__name__}: {e}", fix) from None
    want = expected_output(spec, len(example))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        what = "regression" if spec.get("task") == "regression" else f"{spec['task']} over {spec['n_classes']} classes"
        raise ConfigError("model", f"{name}: a batch of {len(example)} rows gave output {got}, but {spec['kind']} "
                          f"{what} needs {want}", fix)


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


def flops_per_sample(spec: dict[str, Any], n_params: int) -> float:
    """Training FLOPs per sample (forward + backward = 3x forward), the usual 6*N*tokens rule for the
    transformer plus attention (12 * layers * seq * d per token), 6*N for the dense models
    (the CNN's conv FLOPs are counted from its output map size). A user's model is counted by the
    parameter rule (per token for tokens): exact for dense layers, an undercount for convolutions."""
    if spec["model"] == "transformer":
        t = spec["seq_len"]
        return 6.0 * n_params * t + 12.0 * spec["n_layers"] * t * t * spec["d_model"]
    if spec["model"] == "cnn":
        c, h, w = spec["image_shape"]
        conv = 2 * (h * w * 32 * c * 9) + 2 * (h * w * 64 * 32 * 9)
        return 3.0 * conv + 6.0 * n_params
    if spec["kind"] == "tokens":  # a user's model over tokens: the parameter rule per token
        return 6.0 * n_params * spec["seq_len"]
    return 6.0 * n_params
