"""HSDP: FSDP2 on a 2-D mesh (``dp_replicate`` x ``dp_shard``), with real torchrun agents over gloo
on loopback. Two agents of two ranks each act as two nodes: each node holds one sharded copy of the
model and the copies' gradients are all-reduced across the nodes. It trains as plain FSDP on the
same four ranks does, step for step, from the same initial weights; it resumes a plain FSDP
checkpoint (DCP reshards it), and its final checkpoint exports whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlflow.tracking import MlflowClient

from tests.conftest import run_torchrun
from training.tracking.run import get_or_create_experiment
from training.distributed.launch import torchrun_command
from training.util import free_port

pytestmark = pytest.mark.slow
STEPS, EVERY = 20, 10


def _sets(dataset: Path, root: Path, **extra) -> list[str]:
    base = {"dataset_uri": dataset, "checkpoint_dir": root / "ck", "output_dir": root / "out", "steps": STEPS,
            "checkpoint_every": EVERY, "batch_size": 32, "log_every": 5, "strategy": "fsdp", "eval_every": 0,
            "target_metric": "none", **extra}
    return [f"{k}={v}" for k, v in base.items()]


def _losses(root: Path) -> dict[int, float]:
    out = {}
    for line in (root / "out" / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = float.fromhex(rec["loss"])
    return out


def _ok(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _two_nodes(sets: list[str], env: dict[str, str] | None = None) -> str:
    """Two torchrun agents of two ranks, the c10d rendezvous on loopback: node 0 holds ranks 0-1,
    node 1 ranks 2-3. Returns both agents' output."""
    port = free_port()
    cmd = torchrun_command([a for s in sets for a in ("--set", s)], nproc_per_node=2, nnodes="2:2",
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="hsdp-test",
                           options=["--rdzv-conf", "join_timeout=120"])
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **env}) for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    for agent, out in zip(agents, outs):
        assert agent.returncode == 0, out[-4000:]
    return "\n".join(outs)


@pytest.fixture(scope="module")
def plain(dataset, tmp_path_factory) -> Path:
    """Plain FSDP over 4 ranks (a 1-D mesh), checkpoints at steps 10 and 20."""
    root = tmp_path_factory.mktemp("fsdp4")
    out = _ok(run_torchrun(4, _sets(dataset, root)))
    assert "on 4 ranks (fsdp x4)" in out, out[-3000:]
    return root


def test_hsdp_on_two_nodes_trains_as_plain_fsdp_and_resumes_its_checkpoint(dataset, plain, tmp_path):
    ref = _losses(plain)
    hsdp = tmp_path / "hsdp"
    client = MlflowClient()
    run_id = client.create_run(get_or_create_experiment("test-hsdp"), run_name="hsdp").info.run_id
    out = _two_nodes(_sets(dataset, hsdp, dp_replicate=2, log_every=5), env={"MLFLOW_RUN_ID": run_id})
    assert "on 4 ranks (hsdp 2x2 (dp_replicate x dp_shard))" in out, out[-3000:]
    got = _losses(hsdp)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:  # the same sums, reduced in another order: equal within fp32 rounding
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, got[step], ref[step])
    # Communication per mesh dimension: within a node's shard group and across the two copies,
    # the parts of the step's communication time (gloo runs them one at a time).
    run = client.get_run(run_id)
    assert run.data.params["mesh"] == "hsdp 2x2 (dp_replicate x dp_shard)"
    m = run.data.metrics
    shard, replicate, total = m["comm/dp_shard_s_per_step"], m["comm/dp_replicate_s_per_step"], m["comm/s_per_step"]
    assert shard > 0 and replicate > 0, m
    assert shard + replicate == pytest.approx(total, rel=0.02), m  # means over the ranks, as the total is

    # The final checkpoint's export is whole (gathered from both copies' shards) and matches FSDP's.
    exported = load_file(hsdp / "ck" / f"step_{STEPS:08d}" / "model.safetensors")
    expected = load_file(plain / "ck" / f"step_{STEPS:08d}" / "model.safetensors")
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].shape == tensor.shape and torch.allclose(exported[name], tensor, rtol=1e-4, atol=1e-6)

    # Plain FSDP's step-10 checkpoint, resumed under HSDP: DCP reshards it onto the 2-D mesh.
    resumed = tmp_path / "resumed"
    (resumed / "ck").mkdir(parents=True)
    shutil.copytree(plain / "ck" / f"step_{EVERY:08d}", resumed / "ck" / f"step_{EVERY:08d}")
    out = _two_nodes(_sets(dataset, resumed, dp_replicate=-1, dp_shard=2))
    assert f"(step {EVERY})" in out and "resuming from" in out, out[-3000:]
    again = _losses(resumed)
    assert sorted(again) == list(range(EVERY + 1, STEPS + 1))
    for step in again:
        assert again[step] == pytest.approx(ref[step], rel=1e-4), (step, again[step], ref[step])


def test_degrees_that_do_not_fit_the_world_are_refused_before_any_process_group(dataset, tmp_path):
    proc = run_torchrun(2, _sets(dataset, tmp_path, dp_replicate=2, dp_shard=2))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config field 'dp_shard': dp_replicate=2 x dp_shard=2 is 4, not world_size=2" in out, out[-3000:]
    assert "train: " not in proc.stdout  # nothing started
    assert not (tmp_path / "ck").exists()
