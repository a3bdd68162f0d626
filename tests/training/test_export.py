"""The bounded export (training/checkpoint/export.py): the streamed ``model.safetensors`` has the
bytes ``safetensors.torch.save_file`` writes for the same tensors, from the sharded live model
(FSDP2; built-in decoder, a Hugging Face GPT-2 with a tied head) and from a sharded DCP checkpoint
written by two ranks."""

import json
import struct

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from training.checkpoint.export import MODEL_FILE, export_checkpoint, export_model, header, load_exported
from training.models.build import build_model
from training.models.spec import ModelSpec
from training.util import free_port


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_header_is_the_one_safetensors_writes(tmp_path):
    tensors = {"b": torch.ones(3), "a.é": torch.zeros(2, 2, dtype=torch.bfloat16), "c": torch.arange(4),
               "z": torch.ones(5, dtype=torch.bool), "e": torch.empty(0), "s": torch.tensor(2.0, dtype=torch.float16)}
    for metadata in (None, {"format": "pt"}):
        save_file(tensors, tmp_path / "ref", metadata=metadata)
        raw, names = header({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, metadata)
        ref = (tmp_path / "ref").read_bytes()
        assert ref[:len(raw)] == raw
        assert names == [k for k in json.loads(ref[8:8 + struct.unpack("<Q", ref[:8])[0]]) if k != "__metadata__"]


def _decoder_spec() -> ModelSpec:
    return ModelSpec(model="transformer", kind="tokens", task="classification", features=["tokens"], label=None,
                     n_classes=50, vocab_size=50, seq_len=16,
                     arch={"d_model": 32, "n_layers": 2, "n_heads": 4, "dropout": 0.0})


def _gpt2_spec() -> ModelSpec:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    return ModelSpec(model="hf:/nowhere", kind="tokens", task="classification", features=["tokens"], label=None,
                     n_classes=50, vocab_size=50, seq_len=16,
                     arch={"hf_head": "causal_lm", "hf_config": config.to_dict(), "pretrained": False})


@pytest.mark.parametrize("make_spec", [_decoder_spec, _gpt2_spec], ids=["decoder", "gpt2"])
def test_streamed_export_of_a_sharded_model_has_the_old_bytes(tmp_path, group, make_spec):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from training.models.build import shard_units

    spec = make_spec()
    torch.manual_seed(0)
    model = build_model(spec)
    for unit in [*shard_units(model), model]:
        fully_shard(unit)
    export_model(model, tmp_path / "new", spec)
    # What the export wrote before: the full state dict gathered on rank 0, then save_file.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if spec.is_hf:
        seen, tensors = set(), {}
        for k, v in full.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                tensors[k.removeprefix("model.")] = v.contiguous()
        save_file(tensors, tmp_path / "old", metadata={"format": "pt"})
        assert len(tensors) < len(full)  # the tied head is stored once
        assert (tmp_path / "new" / "config.json").is_file()
    else:
        save_file({k: v.contiguous() for k, v in full.items()}, tmp_path / "old")
    assert (tmp_path / "new" / MODEL_FILE).read_bytes() == (tmp_path / "old").read_bytes()
    rebuilt, _ = load_exported(tmp_path / "new")
    for k, v in rebuilt.state_dict().items():
        assert torch.equal(v, full[k]), k
    if spec.is_hf:  # the head stays tied to the embedding: one parameter, as the model was trained
        assert rebuilt.model.lm_head.weight is rebuilt.model.get_input_embeddings().weight


# Load an exported folder in a fresh process; print the growth of its anonymous memory (its own
# pages, as opposed to the mapped file's) and a forward pass's output.
LOAD = """
import sys, torch
from training.checkpoint.export import load_exported
def anonymous():
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Anonymous:")) * 1024
load_exported(sys.argv[2])  # a small model first: what the first load sets up once is not the model's
before = anonymous()
model, spec = load_exported(sys.argv[1])
grown = anonymous() - before
with torch.no_grad():
    out = model(torch.arange(16).remainder(spec.vocab_size)[None])
print(grown, out.double().sum().item())
"""


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_an_exported_model_is_loaded_from_the_mapped_file_without_a_copy(tmp_path, group):
    """Scoring a champion, serving, generating: the weights are the file's pages, not a second copy
    in the process's memory (before: the model built with its own weights, then the file's copied in)."""
    import subprocess
    import sys

    import dataclasses

    spec = dataclasses.replace(_decoder_spec(), vocab_size=16384, n_classes=16384,  # 38 MiB of weights
                               arch={"d_model": 256, "n_layers": 2, "n_heads": 4, "dropout": 0.0})
    torch.manual_seed(0)
    model = build_model(spec).eval()
    export_model(model, tmp_path / "m", spec)
    export_model(build_model(_decoder_spec()), tmp_path / "small", _decoder_spec())
    weights = (tmp_path / "m" / MODEL_FILE).stat().st_size
    done = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "m"), str(tmp_path / "small")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    grown, out = done.stdout.split()
    assert int(grown) < weights / 4, (int(grown), weights)
    with torch.no_grad():
        assert float(out) == model(torch.arange(16).remainder(spec.vocab_size)[None]).double().sum().item()


def _save_shards(rank: int, port: int, root: str, shapes: dict) -> None:
    """One of two ranks: its row-halves of seeded tensors, saved as one DTensor checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = {name: DTensor.from_local(full_tensor(name, shape).chunk(2)[rank], mesh, [Shard(0)])
             for name, shape in shapes.items()}
    dcp.save({"train": {"model": model, "step": torch.tensor(3)}}, checkpoint_id=root)
    dist.destroy_process_group()


def full_tensor(name: str, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, name))))


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_export_of_a_checkpoint_written_by_two_ranks_has_the_old_bytes(tmp_path):
    import torch.multiprocessing as mp

    shapes = {"embed.weight": (10, 6), "blocks.0.w": (8, 4), "blocks.1.w": (8, 4), "head.bias": (6,)}
    mp.spawn(_save_shards, args=(free_port(), str(tmp_path / "ckpt"), shapes), nprocs=2)
    written = export_checkpoint(FileSystemReader(tmp_path / "ckpt"), tmp_path / MODEL_FILE)
    assert sorted(written) == sorted(shapes)
    save_file({name: full_tensor(name, shape) for name, shape in shapes.items()}, tmp_path / "old")
    assert (tmp_path / MODEL_FILE).read_bytes() == (tmp_path / "old").read_bytes()
    assert set(load_file(tmp_path / MODEL_FILE)) == set(shapes)
