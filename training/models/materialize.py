"""Initial weights without a whole model on any rank: the model is built with its parameters on
the meta device (no memory), parallelism is applied, and only then are the parameters
materialised (``to_empty``: each rank allocates its own shards) and given values one parameter at
a time, from a random generator keyed by (seed, parameter name) or read shard by shard from a
pretrained folder. The values depend on neither the device nor the rank, so one rank and N ranks
start bit-identical. Why this design: docs/architecture.md "Initial weights".
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

InitRule = Callable[[str, nn.Module], None]  # (a module's qualified name, the module): re-initialise it


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers (statistics, rotary
    tables) stay real. Written here: accelerate's ``init_empty_weights`` does this, but it is not a
    dependency of the project and this is all of it that is needed."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            cls = type(module._parameters[name])
            module._parameters[name] = cls(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def key(seed: int, name: str) -> int:
    """The seed of one parameter's generator: (run seed, parameter name), nothing else."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def default_rule(model: nn.Module) -> InitRule:
    """The model's own initialisation, module by module: its ``init_module(name, module)`` if it
    has one (the built-ins, a factory model that initialises in its own way), else each module's
    ``reset_parameters`` (torch's layers)."""
    own = getattr(model, "init_module", None)
    if callable(own):
        return own

    def reset(_name: str, module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return reset


class InitialWeights:
    """The initial values of a model built under ``meta_parameters``, set by ``__call__`` after
    parallelism is applied. Made before sharding: it keeps a meta copy of the model (no memory) in
    which the model's own rule draws one parameter at a time."""

    def __init__(self, model: nn.Module, seed: int, *, pretrained: Path | None = None) -> None:
        self.seed, self.pretrained = seed, pretrained
        self.shadow = copy.deepcopy(model) if any(p.is_meta for p in model.parameters()) else None

    def __call__(self, model: nn.Module, device: torch.device) -> None:
        """Allocate ``model``'s meta parameters on ``device`` (each rank only its shards when FSDP2
        has sharded them) and set their values: read from ``pretrained`` (a folder with
        ``model.safetensors``) where it has them, else drawn by the model's rule (``default_rule``)
        applied to the parameter's module and then to each module above it (torch's and Hugging
        Face's order: children first), with the CPU generator seeded by ``key(seed, name)``. One
        parameter is whole at a time, on the CPU."""
        if self.shadow is None:
            return  # built with its weights
        buffers = dict(model.named_buffers())  # real already: to_empty must not lose them
        ties = _shared_parameters(model)
        model.to_empty(device=device)
        for (first, first_attr), *rest in ties:  # to_empty gives each module a tensor of its own
            for module, attr in rest:
                module._parameters[attr] = first._parameters[first_attr]
        with torch.no_grad():
            for name, b in model.named_buffers():
                if not buffers[name].is_meta:
                    b.copy_(buffers[name])
            loaded = _load_pretrained(model, self.pretrained) if self.pretrained is not None else set()
            rule = default_rule(self.shadow)
            for name, param in model.named_parameters():
                if name not in loaded:
                    _fill(param, _drawn(self.shadow, name, self.seed, rule))


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held by more than one module (tied weights:
    a language model's head and its token embedding)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, attr))
    return [p for p in places.values() if len(p) > 1]


def _drawn(shadow: nn.Module, name: str, seed: int, rule: InitRule) -> torch.Tensor:
    """Parameter ``name``'s initial value, whole, on the CPU: in the meta ``shadow`` of the model
    it alone is made real, so the rule's writes to every other parameter cost nothing."""
    owner_name, _, attr = name.rpartition(".")
    owner = shadow.get_submodule(owner_name)
    meta = owner._parameters[attr]
    value = torch.full(meta.shape, float("nan"), dtype=meta.dtype)  # what no rule wrote stays NaN
    owner._parameters[attr] = type(meta)(value, requires_grad=meta.requires_grad)
    parts = owner_name.split(".") if owner_name else []
    chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]  # the owner, then each module above it
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(key(seed, name))
            for qual in chain:
                rule(qual, shadow.get_submodule(qual))
    finally:
        owner._parameters[attr] = meta
    if value.is_floating_point() and value.isnan().any():
        from training.config.fields import ConfigError

        raise ConfigError("model", f"parameter {name} ({type(owner).__name__}) is given no initial value by the "
                          "model's initialisation when built after sharding (strategy=fsdp)",
                          "give the model an init_module(name, module) method that initialises that module's "
                          "parameters (or the module a reset_parameters method), or use strategy=ddp")
    return value


def _fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``param`` (an FSDP2 shard, or the whole tensor)."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        local = param.to_local()
        part = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        local.copy_(part)
    else:
        param.copy_(full)


def _load_pretrained(model: nn.Module, folder: Path) -> set[str]:
    """Read the parameters ``folder/model.safetensors`` holds into ``model``, each rank only the
    rows of its shards (DCP's Hugging Face reader: ``safe_open(...).get_slice``); returns the
    names read. Names are matched as ``save_pretrained`` writes them (the wrapper's ``model.``
    prefix off; a head checkpoint's base-model prefix added or removed)."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    inner = getattr(model, "model", None)
    prefix = getattr(inner, "base_model_prefix", "") or ""
    wanted: dict[str, torch.Tensor] = {}
    names: set[str] = set()
    for name, param in model.named_parameters():
        local = name.removeprefix("model.").replace(".base_layer.", ".")  # a LoRA layer's base weight
        for candidate in (local, local.removeprefix(f"{prefix}."), f"{prefix}.{local}"):
            if candidate in stored and candidate not in wanted:
                if stored[candidate] != tuple(param.shape):
                    from training.config.fields import ConfigError

                    raise ConfigError("model", f"{folder}/model.safetensors holds {candidate} of shape "
                                      f"{list(stored[candidate])}, the model needs {list(param.shape)}",
                                      "train with the folder's own sizes (a classifier's classes: its num_labels), "
                                      "or save the folder without that tensor")
                wanted[candidate] = param
                names.add(name)
                break
    if wanted:
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(folder)),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    return names


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Each second name of a parameter that is another one (an LM head tied to its embedding) ->
    the name it has first."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            tied[name] = first[id(p)]
    return tied


def assign_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """``tensors`` (a state dict by the model's names) become the model's parameters and buffers as
    they are, without a copy (``load_state_dict(assign=True)``): a model built on the meta device
    and a mapped ``safetensors`` file give weights held as the file's pages, which the kernel may
    drop and read again, instead of a second copy in the process's own memory. A parameter shared
    by two names (an LM head tied to its embedding) stays shared whether the file holds it once or
    twice; any other name missing or unexpected is a ValueError naming ``source``."""
    tied = tied_parameters(model)
    want = model.state_dict(keep_vars=True)
    state = {k: v if k not in want or v.dtype == want[k].dtype else v.to(want[k].dtype)
             for k, v in tensors.items() if k not in tied}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - set(tied))
    if missing or result.unexpected_keys:
        raise ValueError(f"{source} does not fit the model: missing {missing[:5]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:5]}")
    for name, to in tied.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = model.get_parameter(to)
