"""comm_hook=powersgd: DDP gradients sent as low-rank factors (torch's PowerSGD hook), with real
torchrun ranks over gloo. What a user checks: the bytes each step sends are what the factors'
sizes say (far fewer than the fp32 gradients), training still learns, and a run resumed from a
checkpoint taken while compressing continues bit for bit as if never stopped (the per-rank error
feedback and warm-start factors are in the checkpoint, moved across DDP's bucket layouts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mlflow.tracking import MlflowClient

from tests.conftest import run_torchrun
from training.tracking.run import get_or_create_experiment

pytestmark = pytest.mark.slow
STEPS, EVERY, RANK = 12, 6, 2


def _sets(dataset: Path, root: Path, **extra) -> list[str]:
    base = {"dataset_uri": dataset, "checkpoint_dir": root / "ck", "output_dir": root / "out", "steps": STEPS,
            "checkpoint_every": EVERY, "batch_size": 32, "log_every": 3, "eval_every": 0, "target_metric": "none",
            "comm_hook": "powersgd", "powersgd_rank": RANK, "powersgd_warmup_steps": 2, **extra}
    return [f"{k}={v}" for k, v in base.items()]


def _losses(root: Path) -> dict[int, str]:
    return {r["step"]: r["loss"] for r in map(json.loads, (root / "out" / "steps.jsonl").read_text().splitlines())}


def _ok(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_powersgd_sends_the_factors_and_resumes_bit_for_bit(dataset, tmp_path):
    client = MlflowClient()
    run_id = client.create_run(get_or_create_experiment("test-powersgd"), run_name="powersgd").info.run_id
    straight = tmp_path / "straight"
    _ok(run_torchrun(2, _sets(dataset, straight), env={"MLFLOW_RUN_ID": run_id}))
    losses = _losses(straight)
    assert float.fromhex(losses[STEPS]) < float.fromhex(losses[1])  # it learns

    # Bytes per step: an n x m weight gradient goes as (n + m) x rank numbers where that is at least
    # 2x smaller (torch's min_compression_rate), everything else whole; fp32, once per rank.
    weights = load_file(straight / "ck" / f"step_{STEPS:08d}" / "model.safetensors")
    sent = whole = 0
    for t in weights.values():
        n = t.shape[0]
        m = t.numel() // n
        r = min(n, m, RANK)
        sent += (n + m) * r if 2 * (n + m) * r < n * m else t.numel()
        whole += t.numel()
    logged = client.get_run(run_id).data.metrics["comm/bytes_per_step"]
    assert logged == 4 * sent, (logged, 4 * sent)
    assert 4 * whole / logged > 10  # the demo MLP's gradients shrink more than tenfold

    # Resumed from step 6 (compressing since step 3): the same losses, bit for bit, and the same weights.
    resumed = tmp_path / "resumed"
    (resumed / "ck").mkdir(parents=True)
    shutil.copytree(straight / "ck" / f"step_{EVERY:08d}", resumed / "ck" / f"step_{EVERY:08d}")
    out = _ok(run_torchrun(2, _sets(dataset, resumed)))
    assert f"(step {EVERY})" in out and "PowerSGD:" not in out, out[-3000:]  # no state dropped
    again = _losses(resumed)
    assert sorted(again) == list(range(EVERY + 1, STEPS + 1))
    assert all(again[s] == losses[s] for s in again), {s: (again[s], losses[s]) for s in again}
    final = load_file(resumed / "ck" / f"step_{STEPS:08d}" / "model.safetensors")
    assert all((final[k] == v).all() for k, v in weights.items())
