"""A decoder whose full training state does not fit one node's memory limit trains with
``strategy=fsdp`` across two nodes, as two pods would run it: two torchrun agents on 127.0.0.1
joined by the c10d rendezvous, one rank each, each agent (and the rank it forks) in its own cgroup
v1 memory group with ``memory.limit_in_bytes`` set, which is how the container runtime applies a
pod's memory limit (tests/memlimit.py). Past the limit the kernel's OOM killer would end the rank.

The figures (built-in decoder, hidden=1024, depth=12, vocabulary 16: 151M parameters, P = 578
MiB in fp32): full training state 4 P (parameters, gradients, AdamW's two moments) = 2316 MiB >
the 2200 MiB limit; each fsdp rank keeps 2 P = 1158 MiB of it, and measured 1665 MiB at its peak
in training and 1824 MiB on rank 0 in the final export (which gathers the whole model there),
beside its agent's 221 MiB (docs/benchmarks.md "Initial weights", where the whole-model build's
683 MiB is set against the sharded build's 387 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import memlimit
from tests.conftest import free_port
from training.data.synthetic import make_markov_dataset
from training.distributed.launch import torchrun_command

LIMIT = 2200 << 20  # bytes, per node (agent + rank)
HIDDEN, DEPTH = 1024, 12


def decoder_parameters(vocab: int, hidden: int = HIDDEN, depth: int = DEPTH) -> int:
    mlp = 64 * -(-8 * hidden // 3 // 64)
    block = 4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden
    return 2 * vocab * hidden + depth * block + hidden


def _agent(sets: dict, port: int, group: memlimit.MemoryGroup, log: Path) -> subprocess.Popen:
    train = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    cmd = torchrun_command(train, nproc_per_node=1, nnodes="2:2", rdzv_endpoint=f"127.0.0.1:{port}",
                           rdzv_id="limit-test", options=["--rdzv-conf", "join_timeout=120"])
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, preexec_fn=group.enter)


@pytest.mark.slow
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_a_decoder_larger_than_a_nodes_limit_trains_with_fsdp_on_two_nodes(tmp_path):
    data = tmp_path / "markov"
    meta = make_markov_dataset(data, n_train=64, n_val=8, vocab=16, seq_len=16)
    full_state = 4 * 4 * decoder_parameters(meta["vocab_size"])
    assert full_state > LIMIT  # the whole training state would not fit one node
    sets = {"dataset_uri": data, "model": "transformer", "hidden": HIDDEN, "depth": DEPTH, "n_heads": 8,
            "strategy": "fsdp", "steps": 2, "batch_size": 2, "checkpoint_every": 0, "log_every": 1,
            "checkpoint_dir": tmp_path / "ck", "output_dir": tmp_path / "out"}
    port = free_port()
    with memlimit.MemoryGroup("dtp-node0", LIMIT) as node0, memlimit.MemoryGroup("dtp-node1", LIMIT) as node1:
        agents = [_agent(sets, port, g, tmp_path / f"node{i}.log") for i, g in enumerate((node0, node1))]
        codes = [a.wait(timeout=300) for a in agents]
        peaks, kills = [node0.peak, node1.peak], [node0.oom_kills, node1.oom_kills]
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    print(f"per-node peak {[round(p / 2**20) for p in peaks]} MiB under a {LIMIT >> 20} MiB limit; "
          f"full training state {full_state >> 20} MiB")
    assert codes == [0, 0] and kills == [0, 0], (codes, kills, logs[0][-3000:], logs[1][-3000:])
    assert max(peaks) <= LIMIT
    manifest = json.loads((tmp_path / "ck" / "step_00000002" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["world_size"] == 2


@pytest.mark.slow  # starts a Python process (tests/processes.py)
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_the_limit_is_enforced():
    """A process past its group's limit is killed by the kernel: the limit above is a real one."""
    with memlimit.MemoryGroup("dtp-limit-check", 64 << 20) as group:
        proc = subprocess.run([sys.executable, "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"],
                              preexec_fn=group.enter, capture_output=True)
        kills = group.oom_kills
    assert proc.returncode == -9 and kills == 1
