"""The portable model: ``model.safetensors`` + ``model_config.json``, written from the sharded
model (or from a sharded DCP checkpoint) one tensor at a time, and rebuilt anywhere without pickle.

Bounded: no process ever holds more than one full tensor of the model (plus DCP's read of it):
the safetensors header is written first from the names, shapes and dtypes alone, then each tensor
is made whole (an all-gather of its shards, or a DCP read of its pieces), written and dropped.
The bytes are those ``safetensors.torch.save_file`` writes for the same tensors (a test compares
them). Why by hand: docs/architecture.md "Bounded export".
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from training.models.spec import ModelSpec
from training.util import atomic_write


MODEL_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"  # a language model's tokenizer, exported beside it
HF_CONFIG_FILE = "config.json"  # an hf: model's: the folder is what from_pretrained loads
ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")  # an adapter's, as peft saves it
ADAPTER_WEIGHTS = ADAPTER_FILES[1]
EXPORTED = (MODEL_FILE, MODEL_CONFIG_FILE, TOKENIZER_FILE, HF_CONFIG_FILE, *ADAPTER_FILES)  # the files of an export that exist
CHECKPOINT_MODEL = "train.model."  # the model's tensors in a trainer checkpoint (TrainState, flattened by DCP)

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # file name -> dtype, shape, in any order


# --------------------------------------------------------------------------- the streaming writer


def header(layout: Layout, metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The safetensors header of tensors of these dtypes and shapes, and the order their bytes
    follow it in. The order and the dtype names are safetensors' own: they are read from the header
    it writes for empty tensors of the same names and dtypes (it sorts by dtype size, then name)."""
    from safetensors.torch import save

    empty = save({name: torch.empty((0,), dtype=dtype) for name, (dtype, _) in layout.items()})
    entries = json.loads(empty[8:8 + struct.unpack("<Q", empty[:8])[0]])
    entries.pop("__metadata__", None)
    head: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, entry in entries.items():
        dtype, shape = layout[name]
        end = offset + _numel(shape) * dtype.itemsize
        head[name] = {"dtype": entry["dtype"], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header with spaces to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, list(entries)


def write_streamed(path: Path | None, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]],
                   metadata: dict[str, str] | None = None) -> None:
    """Write ``path`` (atomically) from ``tensors``, an iterable that yields each tensor of
    ``layout`` whole, one at a time, in ``order(layout)``. ``path=None``: consume the tensors only
    (the ranks that take part in gathering them but do not write)."""
    raw, names = header(layout, metadata)
    tmp = Path(f"{path}.tmp") if path is not None else None
    f = open(tmp, "wb") if tmp is not None else None
    try:
        if f is not None:
            f.write(raw)
        for expected, (name, t) in zip(names, tensors, strict=True):
            if name != expected or tuple(t.shape) != layout[name][1] or t.dtype != layout[name][0]:
                raise ValueError(f"export: got {name} {tuple(t.shape)} {t.dtype} where {expected} "
                                 f"{layout[expected][1]} {layout[expected][0]} was announced")
            if f is not None:
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            del t
        if f is not None:
            f.close()
            os.replace(tmp, path)
    finally:
        if f is not None and not f.closed:
            f.close()
            tmp.unlink(missing_ok=True)


def order(layout: Layout) -> list[str]:
    return header(layout)[1]


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --------------------------------------------------------------------------- from the live, sharded model


def export_model(model, path: str | Path, spec: ModelSpec, tokenizer_file: Path | None = None,
                 base_sha256: str | None = None) -> None:
    """Collective: write safetensors + its config (and a language model's ``tokenizer.json``) on
    rank 0. Every rank gathers one tensor at a time (FSDP2's shards, all-gathered), rank 0 writes it.
    ``base_sha256``: an adapter's base weights as the run hashed them at its start (not read again)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from training.distributed.parallel import full_tensor

    state = get_model_state_dict(model)  # this rank's shards (DTensors) or, under DDP, the tensors
    inner = getattr(model, "module", model)  # DDP's wrapped module
    names = _file_names(list(state), inner, spec)
    layout = {names[k]: (v.dtype, tuple(v.shape)) for k, v in state.items() if k in names}
    by_file = {f: k for k, f in names.items()}
    main = dist.get_rank() == 0
    path = Path(path)
    if main:
        path.mkdir(parents=True, exist_ok=True)
    adapted = spec.is_hf and bool(spec.arch.get("adapter")) and not spec.arch["adapter"].get("merged")
    merge = {}
    if adapted:  # the adapters first, to their own folder; the merged model then, unless merge_adapter=false
        from training.models.hf import ADAPTER_DIR, exported_arch, merged, merges

        merge = merges(inner)
        _export_adapter(state, inner, spec, path / ADAPTER_DIR, main)
        if not spec.arch["adapter"].get("merge", True):
            if main:
                _write_beside(path, dataclasses.replace(spec, arch=exported_arch(spec.arch, spec.model, merged=False,
                                                                         base_sha256=base_sha256)),
                              tokenizer_file)
            dist.barrier()
            return

    def whole():
        for name in order(layout):
            key = by_file[name]
            t = full_tensor(state[key])
            if key in merge:
                a, b, scaling, transposed = merge[key]
                t = merged(t, full_tensor(state[a]), full_tensor(state[b]), scaling, transposed)
            yield name, t

    write_streamed(path / MODEL_FILE if main else None, layout, whole(), _file_metadata(spec))
    if main:
        if adapted:
            spec = dataclasses.replace(spec, arch=exported_arch(spec.arch, spec.model, merged=True,
                                                                 base_sha256=base_sha256))
        _write_beside(path, spec, tokenizer_file)
    dist.barrier()


def _export_adapter(state: dict[str, torch.Tensor], model, spec: ModelSpec, path: Path, main: bool) -> None:
    """Collective: the trained adapters (and a classifier's head) as peft saves them, gathered whole
    one at a time on every rank (they are small), written by rank 0 with their ``adapter_config.json``."""
    from training.distributed.parallel import full_tensor
    from training.models.hf import adapter_names, write_adapter_config

    names = adapter_names(list(state), model)
    layout = {f: (state[k].dtype, tuple(state[k].shape)) for k, f in names.items()}
    by_file = {f: k for k, f in names.items()}
    if main:
        write_adapter_config(path, model, spec.model.removeprefix("hf:"))
    write_streamed(path / "adapter_model.safetensors" if main else None, layout,
                   ((f, full_tensor(state[by_file[f]])) for f in order(layout)), {"format": "pt"})


def _file_names(state_names: list[str], model, spec: ModelSpec) -> dict[str, str]:
    if spec.is_hf:
        from training.models.hf import export_names

        return export_names(state_names, model)
    return {k: k for k in state_names}


def _file_metadata(spec: ModelSpec) -> dict[str, str] | None:
    if spec.is_hf:
        from training.models.hf import EXPORT_METADATA

        return EXPORT_METADATA
    return None


def _write_beside(path: Path, spec: ModelSpec, tokenizer_file: Path | None) -> None:
    if spec.is_hf:
        from training.models.hf import write_config

        write_config(spec.arch, path)
    atomic_write(path / MODEL_CONFIG_FILE, json.dumps(spec.to_json(), indent=2) + "\n")
    if tokenizer_file is not None:
        atomic_write(path / TOKENIZER_FILE, Path(tokenizer_file).read_text())


# --------------------------------------------------------------------------- from a sharded DCP checkpoint


def export_checkpoint(reader, out: str | Path, *, prefix: str = CHECKPOINT_MODEL,
                      rename: Callable[[str], str | None] = lambda k: k,
                      metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``out`` (a ``model.safetensors``) from the tensors under ``prefix`` of the DCP
    checkpoint ``reader`` reads (a ``FileSystemReader``, the trainer's ``VerifiedReader``), in one
    process, one tensor at a time: each is read whole from its shards by DCP (``dcp.load`` of that
    tensor alone, whatever world size wrote it), written and dropped. ``rename``: the name in the
    file (None: leave it out). Returns the names written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = reader.read_metadata()
    keys = {}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            name = rename(key.removeprefix(prefix))
            if name is not None:
                keys[name] = (key, item.properties.dtype, tuple(item.size))
    layout = {name: (dtype, shape) for name, (_, dtype, shape) in keys.items()}

    def whole():
        for name in order(layout):
            key, dtype, shape = keys[name]
            t = {key: torch.empty(shape, dtype=dtype)}
            dcp.load(t, storage_reader=reader, no_dist=True)
            yield name, t.pop(key)

    write_streamed(Path(out), layout, whole(), metadata)
    return list(layout)


# --------------------------------------------------------------------------- reading it back


def read_spec(path: str | Path) -> ModelSpec:
    """The spec of an exported model folder (its ``model_config.json``), without building the model."""
    return ModelSpec.from_json(json.loads((Path(path) / MODEL_CONFIG_FILE).read_text()))


def tensor_bytes(path: str | Path) -> int:
    """The bytes of the tensors of an exported folder's ``model.safetensors`` (an adapter-only export's:
    its base's and its adapter's), from their headers alone."""
    path = Path(path)
    if not (path / MODEL_FILE).is_file() and (path / ADAPTER_WEIGHTS).is_file():
        from training.models.hf import base_weights

        return _header_bytes(base_weights(read_spec(path))) + _header_bytes(path / ADAPTER_WEIGHTS)
    return _header_bytes(path / MODEL_FILE)


def _header_bytes(file: Path) -> int:
    with open(file, "rb") as f:
        head = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return max((e["data_offsets"][1] for k, e in head.items() if k != "__metadata__"), default=0)


def is_exported(path: str | Path) -> bool:
    """Whether the folder holds an exported model: its weights, or an adapter-only export's adapter."""
    return (Path(path) / MODEL_FILE).is_file() or (Path(path) / ADAPTER_WEIGHTS).is_file()


def load_exported(path: str | Path):
    """Rebuild the model from ``model.safetensors`` + ``model_config.json`` (no pickle involved).
    The model is built with its parameters on the meta device and takes the file's tensors as they
    are: safetensors maps the file, so the weights are the file's pages (shared between processes
    that load the same folder, dropped and read again under memory pressure), not a copy. A
    factory model is built as its function builds it (its constructor may need real weights)."""
    from safetensors.torch import load_file

    from training.models.build import build_model
    from training.models.materialize import assign_weights

    path = Path(path)
    spec = read_spec(path)
    if not (path / MODEL_FILE).is_file() and (path / ADAPTER_WEIGHTS).is_file():
        return _load_adapted(path / ADAPTER_WEIGHTS, spec).eval(), spec
    model = build_model(spec, meta=not spec.is_factory)
    tensors = load_file(str(path / MODEL_FILE))
    if spec.is_hf:  # the folder's names are the hf model's own
        tensors = {f"model.{k}": v for k, v in tensors.items()}
    assign_weights(model, tensors, path / MODEL_FILE)
    return model.eval(), spec  # for inference: dropout off


def _load_adapted(adapter_file: Path, spec: ModelSpec) -> torch.nn.Module:
    """An adapter-only export (``merge_adapter=false``) as a model: the base read from its folder,
    refused when its weights are no longer those trained on, with the adapter's tensors (and a
    classifier's head) from ``adapter_file``."""
    from safetensors.torch import load_file

    from training.checkpoint.commit import CheckpointCorrupt
    from training.models.build import build_model
    from training.models.hf import HFModel, adapter_names, base_weights
    from training.util import sha256_file

    base = spec.arch["adapter"]["base"]
    weights = base_weights(spec)
    found = sha256_file(weights) if weights.is_file() else "missing"
    if found != base["sha256"]:
        raise CheckpointCorrupt(
            f"the adapter {adapter_file.parent} was trained on {weights} with sha256 {base['sha256']}, and that file "
            f"is now {found if found == 'missing' else 'sha256 ' + found}: put the base it was trained on back at "
            f"that path, or train again with merge_adapter=true for an export that holds the whole model")
    model = build_model(spec, pretrained=True)
    inner = next(m for m in model.modules() if isinstance(m, HFModel))  # Tabular may wrap it
    own = inner.state_dict(keep_vars=True)
    names = adapter_names(list(own), inner)
    tensors = load_file(str(adapter_file))
    missing = sorted(f for f in names.values() if f not in tensors)
    if missing:
        raise CheckpointCorrupt(f"{adapter_file} lacks {len(missing)} of the adapter's tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for key, name in names.items():
            own[key].copy_(tensors[name])
    return model
