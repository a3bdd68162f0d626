"""The memory preflight and estimate against real runs: ``torchrun`` launched into a cgroup v1
memory group whose ``memory.limit_in_bytes`` is set as root, the way a container runtime sets a
pod's memory limit (tests/cgroup.py), so the ranks read the limit from their own cgroup. Then:
the estimate lies within ±25% of each rank's measured peak (its maximum resident set) across
strategies, world sizes and activation checkpointing; under one limit, activation checkpointing
``full`` trains at a sequence length that ``none`` is refused at (exit 2, its estimate over the
budget); and a decoder whose training state exceeds the limit is refused under ``ddp`` before it
trains, on two "nodes" (two torchrun agents, one rank each, each in its own limited group)."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from tests.cgroup import MemoryLimit
from training.config.train_config import TrainConfig
from training.data.synthetic import make_markov_dataset
from training.distributed.launch import torchrun_command
from training.metrics import memory
from training.models.spec import ModelSpec
from training.util import free_port

pytestmark = pytest.mark.slow
MiB = 1 << 20


def _env(tmp_path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    return {**base, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TRAINING_CACHE_DIR": str(tmp_path / "cache")}


def _sets(data, out, **kw) -> list[str]:
    values = {"dataset_uri": data, "model": "transformer", "steps": 2, "log_every": 2, "checkpoint_every": 0,
              "warmup_steps": 0, "checkpoint_dir": out / "ck", "output_dir": out, **kw}
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def _train(nproc: int, sets: list[str], tmp_path, *, limit: MemoryLimit | None = None, timeout: float = 600):
    cmd = torchrun_command(sets, nproc_per_node=nproc, master_port=free_port())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(tmp_path),
                          preexec_fn=limit.enter if limit else None)


@pytest.fixture(scope="module")
def decoder_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder")
    make_markov_dataset(root, n_train=32, n_val=8, vocab=8192, seq_len=128)
    return root


@pytest.mark.parametrize("strategy,world,ac", [("ddp", 1, "none"), ("ddp", 2, "full"), ("fsdp", 2, "none"),
                                               ("fsdp", 1, "full")])
def test_the_estimate_is_within_a_quarter_of_each_ranks_measured_peak(decoder_data, tmp_path, strategy, world, ac):
    out = tmp_path / "out"
    done = _train(world, _sets(decoder_data, out, hidden=384, depth=4, n_heads=4, batch_size=4 * world,
                               strategy=strategy, activation_checkpointing=ac), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    mem = json.loads((out / "memory.json").read_text())
    est, peaks = mem["estimate"]["total_bytes"], mem["peak_bytes_rank"]
    assert len(peaks) == world and mem["estimate"]["setup"]["strategy"] == strategy
    model_terms = sum(v for k, v in mem["estimate"]["terms_bytes"].items() if k != "baseline")
    assert model_terms > 0.3 * est  # the model, not the process, makes much of what is compared
    for peak in peaks:
        assert 0.75 * peak <= est <= 1.25 * peak, (est / MiB, [p / MiB for p in peaks], mem["estimate"]["terms_bytes"])


def _tokens_spec(vocab: int, seq_len: int, *, hidden: int, depth: int) -> ModelSpec:
    meta = {"kind": "tokens", "vocab_size": vocab, "seq_len": seq_len, "n_classes": vocab,
            "features": [f"t{i}" for i in range(seq_len + 1)], "label": None}
    return ModelSpec.for_data("transformer", meta, hidden=hidden, depth=depth, n_heads=4, dropout=0.0)


def test_activation_checkpointing_full_trains_where_none_is_refused(tmp_path, monkeypatch):
    vocab, seq_len, batch = 512, 1024, 8
    data = tmp_path / "long"
    make_markov_dataset(data, n_train=16, n_val=8, vocab=vocab, seq_len=seq_len)
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    spec, example = _tokens_spec(vocab, seq_len, hidden=128, depth=6), np.zeros(seq_len + 1, dtype=np.int64)
    cfg = TrainConfig(dataset_uri=str(data), model="transformer", hidden=128, depth=6, batch_size=batch)
    data_bytes = 16 * (seq_len + 1) * 8
    none = memory.estimate(cfg, spec, example, world_size=1, data_bytes=data_bytes)
    full = memory.estimate(TrainConfig(**{**cfg.to_dict(), "activation_checkpointing": "full"}), spec, example,
                           world_size=1, data_bytes=data_bytes)
    assert full.total + (256 << 20) < none.total  # the estimate says none needs far more
    # The limit: the agent, then a rank's budget halfway between the two estimates.
    limit = memory.AGENT_CPU + (64 << 20) + (none.total + full.total) // 2
    sets = dict(hidden=128, depth=6, n_heads=4, batch_size=batch)
    with MemoryLimit(limit) as cg:
        refused = _train(1, _sets(data, tmp_path / "none", **sets, activation_checkpointing="none"), tmp_path, limit=cg)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
    assert f"estimated peak memory {memory.gib(none.total)}" in out and "activation_checkpointing=full (estimate" in out
    assert "the memory limit of cgroup v1" in out and not (tmp_path / "none" / "memory.json").exists()
    with MemoryLimit(limit) as cg:
        trained = _train(1, _sets(data, tmp_path / "full", **sets, activation_checkpointing="full"), tmp_path, limit=cg)
        kills = cg.oom_kills
    assert trained.returncode == 0 and kills == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    measured = json.loads((tmp_path / "full" / "memory.json").read_text())["peak_bytes_rank"][0]
    assert measured < limit and json.loads((tmp_path / "full" / "train_summary.json").read_text())["final_step"] == 2


def test_a_decoder_whose_training_state_exceeds_the_limit_is_refused_under_ddp(tmp_path, monkeypatch):
    data = tmp_path / "big"
    make_markov_dataset(data, n_train=8, n_val=4, vocab=8192, seq_len=32)
    hidden, depth = 1024, 8  # ~117M parameters: params + gradients + AdamW = 1.9 GB per ddp replica
    limit = 1536 * MiB  # a node's (a pod's) memory limit
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    cfg = TrainConfig(dataset_uri=str(data), model="transformer", hidden=hidden, depth=depth, n_heads=8, batch_size=2)
    est = memory.estimate(cfg, _tokens_spec(8192, 32, hidden=hidden, depth=depth), np.zeros(33, dtype=np.int64),
                          world_size=2)
    state = est.terms["parameters"] + est.terms["gradients"] + est.terms["optimizer"]
    assert state == 16 * est.setup["parameters"] > limit
    sets = _sets(data, tmp_path / "out", hidden=hidden, depth=depth, n_heads=8, batch_size=2, strategy="ddp")
    port = free_port()
    cmd = torchrun_command(sets, nproc_per_node=1, nnodes="2", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="ddp-refused")
    with MemoryLimit(limit) as node0, MemoryLimit(limit) as node1:
        agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path),
                                   preexec_fn=node.enter) for node in (node0, node1)]
        outs = [a.communicate(timeout=300)[0] for a in agents]
        kills = node0.oom_kills + node1.oom_kills
    assert kills == 0
    for agent, out in zip(agents, outs):
        assert agent.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
        assert "config field 'strategy'" in out and "is more than its budget" in out and "strategy=fsdp" in out
        assert f"parameters {memory.gib(est.terms['parameters'])} + gradients" in out, out[-3000:]
    assert not (tmp_path / "out" / "memory.json").exists()  # refused before training
