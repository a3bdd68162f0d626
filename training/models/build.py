"""Building a model from its ``ModelSpec``: a built-in family or the user's factory
(``package.module:function``, imported where the model is built: the ranks, the pods, the Airflow
worker's pre-launch check, evaluation and the registry), which gets the spec's JSON as a dict and
returns an ``nn.Module``. A table's model is wrapped in ``Tabular``, which standardizes features and
scales a regression output with train's statistics (buffers: they travel with the weights).
Parallelism is applied from outside; ``shard_units`` names a model's blocks and ``fsdp_layout``
everything FSDP shards one by one.
``check_model`` runs two rows through it before any rank starts; ``ConfigError`` names ``model``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from typing import Any, Callable

import numpy as np

import torch
from torch import nn

from training.config.fields import ConfigError
from training.models.builtin import CNN, MLP, TextClassifier, Transformer
from training.models.materialize import InitialWeights, default_rule, meta_parameters
from training.models.spec import ModelSpec


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

    def init_module(self, name: str, m: nn.Module) -> None:
        """The wrapped model's initialisation (its names without ``model.``); the statistics are
        buffers, set in the constructor."""
        if name == "model" or name.startswith("model."):
            default_rule(self.model)(name.removeprefix("model").removeprefix("."), m)

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


# A module outside the blocks holding fewer parameters than this (4 MiB in fp32: a norm, a small
# head) stays with the root: a collective of its own each step would cost more than it saves.
OUTER_UNIT_MIN_NUMEL = 1 << 20


def fsdp_layout(model: nn.Module) -> list[nn.Module]:
    """What FSDP2 shards one by one before the root: the blocks (``shard_units``), then each module
    outside them that holds at least ``OUTER_UNIT_MIN_NUMEL`` parameters (an embedding, an output
    head), as torchtitan shards its embedding and output apart. The root's parameters stay gathered
    from the first forward to the end of backward, so a large vocabulary's embedding and head left
    there would be held whole on every rank; as units they are gathered only while they compute.
    A module sharing a parameter with another (a head tied to the embedding) stays with the root,
    since one parameter cannot be sharded by two units. Nothing is wrapped here."""
    blocks = shard_units(model)
    block_ids = {id(b) for b in blocks}
    owners: dict[int, int] = {}  # parameter -> how many modules hold it directly
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    outer: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in block_ids:
                continue
            if any(id(m) in block_ids for m in child.modules()):
                walk(child)  # holds blocks: its other children may be units, its own parameters stay with the root
                continue
            params = list(child.parameters())
            if sum(p.numel() for p in params) >= OUTER_UNIT_MIN_NUMEL and all(owners[id(p)] == 1 for p in params):
                outer.append(child)

    walk(model)
    return [*blocks, *outer]


def used_last(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The units of ``fsdp_layout`` outside the blocks that the model registers after its last block
    (an output head): used last in forward and first in backward, they stay gathered in between
    (FSDP2's ``reshard_after_forward=False``, as torchtitan leaves its output layer) instead of
    being freed and gathered again at once. Where the order of registration is not the order of
    use, such a unit is held as the root would have held it, no longer."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    blocks = shard_units(model)
    if not blocks:
        return []
    last = max(order[id(b)] for b in blocks)
    block_ids = {id(b) for b in blocks}
    return [u for u in units if id(u) not in block_ids and order[id(u)] > last]


def factory(path: str) -> Callable[[dict[str, Any]], nn.Module]:
    """The function ``package.module:function`` names (imported now)."""
    module_name, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"{attr} in {module_name} is a {type(fn).__name__}, not a function")
    return fn


def _build_inner(spec: ModelSpec, pretrained: bool = False) -> nn.Module:
    a = spec.arch
    if spec.model == "mlp":
        return MLP(in_features=spec.in_features, n_classes=spec.n_classes, hidden=a["hidden"], depth=a["depth"])
    if spec.model == "cnn":
        return CNN(image_shape=spec.image_shape, n_classes=spec.n_classes, hidden=a["hidden"], scale=a["scale"])
    if spec.model == "transformer" and spec.kind == "text":  # a classifier over documents
        return TextClassifier(vocab_size=spec.vocab_size, n_classes=spec.n_classes, pad_id=spec.pad_id,
                              d_model=a["d_model"], n_layers=a["n_layers"], n_heads=a["n_heads"], dropout=a["dropout"])
    if spec.model == "transformer":
        return Transformer(vocab_size=spec.vocab_size, seq_len=spec.seq_len, d_model=a["d_model"],
                           n_layers=a["n_layers"], n_heads=a["n_heads"], dropout=a["dropout"])
    if spec.is_hf:
        from training.models.hf import HFModel, folder

        source = folder(spec.model) if pretrained and spec.arch.get("pretrained") else None
        return HFModel(spec.arch, pad_id=spec.pad_id, pretrained_from=source)
    model = factory(spec.model)(copy.deepcopy(spec.to_json()))  # the user's function may keep or change its dict
    if not isinstance(model, nn.Module):
        raise TypeError(f"returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(spec: ModelSpec, *, pretrained: bool = False, meta: bool = False) -> nn.Module:
    """The model ``spec`` describes, with the data transform of a table inside (``Tabular``).
    ``pretrained``: an ``hf:`` model starts from its folder's weights (where it has them).
    ``meta``: parameters on the meta device, without values (``build_for_training``)."""
    with meta_parameters() if meta else contextlib.nullcontext():
        model = _build_inner(spec, pretrained and not meta)
    norm, target = spec.normalization, spec.target
    if norm is None and target is None:
        return model
    return Tabular(model, mean=norm and norm["mean"], std=norm and norm["std"], target=target)


def build_for_training(spec: ModelSpec, *, seed: int, strategy: str) -> tuple[nn.Module, InitialWeights]:
    """The model with its parameters on the meta device, and what gives them their initial values
    once parallelism is applied (``InitialWeights``: drawn keyed by (seed, name), or an ``hf:``
    folder's weights read shard by shard). A factory model under ddp is built as its function
    builds it (its own initialisation, whatever it is); under fsdp its modules are re-initialised
    by its ``init_module(name, module)`` or each module's ``reset_parameters``."""
    meta = strategy == "fsdp" or not spec.is_factory
    model = build_model(spec, pretrained=not meta, meta=meta)
    source = None
    if meta and spec.is_hf and spec.arch.get("pretrained"):
        from training.models.hf import folder

        source = folder(spec.model)
    return model, InitialWeights(model, seed, pretrained=source)


def check_model(spec: ModelSpec, example: np.ndarray, *, strategy: str = "ddp") -> None:
    """Build the model and run ``example`` (a few rows of model input) through it; ConfigError
    naming ``model`` with the factory path and the error when that fails or the output does not
    fit the task. With fsdp, every ``fsdp_units`` entry must be a sub-module of the model, and the
    check runs on the meta device (shapes only: the whole model is never built), or for real
    where the model cannot run there."""
    if strategy == "fsdp":
        try:
            return _check(spec, example, strategy, meta=True)
        except ConfigError as e:
            if "meta" not in str(e).lower():
                raise
    return _check(spec, example, strategy, meta=False)


def _check(spec: ModelSpec, example: np.ndarray, strategy: str, *, meta: bool) -> None:
    name = spec.model
    fix = ("make the factory importable where the model is built (PYTHONPATH, or the training image), return a "
           "torch.nn.Module built from the spec dict, and give one output per class (tables, images: [batch, "
           "n_classes]; regression: [batch, 1]; tokens: [batch, seq_len, vocab_size])")
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        try:
            model = build_model(spec, meta=meta)
        except ConfigError:
            raise  # names its own field (an adapter's target modules)
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
        if meta:
            model.to("meta")  # buffers too (a table's statistics), beside the meta inputs
        model.eval()
        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(example))
            if spec.kind == "tokens":
                x = x[:, :-1]
            out = model(x.to("meta") if meta else x)
    except Exception as e:
        raise ConfigError("model", f"{name}: {type(e).__name__}: {e}", fix) from None
    want = (len(example), *spec.output_shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        what = "regression" if spec.task == "regression" else f"{spec.task} over {spec.n_classes} classes"
        raise ConfigError("model", f"{name}: a batch of {len(example)} rows gave output {got}, but {spec.kind} "
                          f"{what} needs {want}", fix)
