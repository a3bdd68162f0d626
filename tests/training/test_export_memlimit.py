"""The export of a sharded model stays under a pod's memory limit: a model state written by two
ranks as a DCP checkpoint, larger than the limit, is exported to ``model.safetensors`` by a
process under that limit (a cgroup memory limit, as a container runtime sets a pod's; see
tests/memlimit.py); loading the whole state the way the export did before is killed by
the same limit."""

import sys

import pytest
import torch
from safetensors import safe_open

from tests import memlimit
from training.checkpoint.export import MODEL_FILE
from training.util import free_port

N, SHAPE = 10, (4096, 4096)  # ten tensors of 64 MiB: 640 MiB of model state
TENSOR = SHAPE[0] * SHAPE[1] * 4
BUDGET = 3 * TENSOR  # what the limit leaves above the interpreter's own memory

CHILD = r"""
import sys
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from training.checkpoint.export import export_checkpoint
mode, ckpt, out = sys.argv[1:]
import resource
print("ready", flush=True)
ready = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sys.stdin.readline()  # the limit is set now
reader = FileSystemReader(ckpt)
if mode == "stream":
    export_checkpoint(reader, out)
else:  # the export before: the whole state in memory, then one save_file
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("train.model.")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    save_file({k.removeprefix("train.model."): v for k, v in state.items()}, out)
print("done, resident set grew by", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - ready, flush=True)
"""


def _name(i: int) -> str:
    return f"blocks.{i}.weight"


def _tensor(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def _save_shards(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = {_name(i): DTensor.from_local(_tensor(i).chunk(2)[rank].clone(), mesh, [Shard(0)]) for i in range(N)}
    dcp.save({"train": {"model": model}}, checkpoint_id=root)
    dist.destroy_process_group()


def _under_limit(mode: str, ckpt, out) -> tuple[int, str, int, int]:
    """Run the export ``mode`` in a fresh memory group: once the interpreter is up, its limit is
    set to what it uses then + BUDGET. Returns exit code, output, limit, peak."""
    return memlimit.run_once_ready("dtp-export", [sys.executable, "-c", CHILD, mode, str(ckpt), str(out)], BUDGET)


@pytest.mark.slow
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_export_of_a_sharded_model_stays_under_the_limit(tmp_path):
    import torch.multiprocessing as mp

    ckpt = tmp_path / "ckpt"
    mp.spawn(_save_shards, args=(free_port(), str(ckpt)), nprocs=2)

    rc, output, limit, peak = _under_limit("stream", ckpt, tmp_path / MODEL_FILE)
    assert rc == 0 and "done" in output, output[-3000:]
    assert N * TENSOR > limit, "the model state must be larger than the limit"
    grew = int(output.split("grew by")[1])
    assert peak <= limit and grew < BUDGET  # a few tensors' worth, not the model's
    print(f"model state {N * TENSOR / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB (the group's peak, page "
          f"cache included: {peak / 2**20:.0f} MiB), the export's resident set grew by {grew / 2**20:.0f} MiB")
    with safe_open(tmp_path / MODEL_FILE, "pt") as f:
        assert sorted(f.keys()) == sorted(_name(i) for i in range(N))
        for i in (0, N - 1):
            assert torch.equal(f.get_tensor(_name(i)), _tensor(i))

    rc, output, _, _ = _under_limit("whole", ckpt, tmp_path / "whole.safetensors")
    assert rc == -9, f"loading the whole state was not stopped by the limit (exit {rc}): {output[-2000:]}"
