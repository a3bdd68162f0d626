"""Rank 0's MLflow calls relayed through stdout to the process that launched it (the local
backend's train task): ``tracking.relay.RelayLogger`` in a real child process, ``RelayReceiver`` here,
a real MLflow store. The run must end up with what direct logging gives it, and rank 0 must not
import MLflow at all (the point of the relay)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT
from training.tracking.relay import RELAY_ENV, RelayReceiver
from training.tracking.run import RunLogger

RANK0 = """
import sys
from training.tracking.run import OnceLogger
from training.tracking.relay import logger_for

mlflow = logger_for(True)
print(type(mlflow).__name__)
mlflow.log_params({f"p{i:03d}": "x" * 100 for i in range(100)})  # more than one line can hold
once = OnceLogger(mlflow)  # as the trainer logs windows, evaluation, checkpoints
for step in (10, 20, 30, 20):  # step 20 replayed after a restart
    once.log_metrics({"train/loss": step / 100, "perf/step_s": 0.01}, step=step)
mlflow.log_metrics({"fault/restarts": 1.0}, step=20)  # plain log_metrics: every call is a point
mlflow.log_metrics({"fault/restarts": 2.0}, step=20)
mlflow.log_metrics_once({"summary/wall_s": 3.5}, step=30)
mlflow.set_tags({"checkpoint.local_path": "/ck/step_00000030"})
mlflow.log_text("rank 0 was here", "notes/rank0.txt")  # any RunLogger method is relayed by name
assert getattr(mlflow, "client", None) is None and mlflow.run_id is None  # no client, no run of its own
print("step 30/30 | an ordinary progress line")
print("mlflow imported:", "mlflow" in sys.modules)
"""


def _run_rank0(run_id: str) -> list[str]:
    env = {**os.environ, "MLFLOW_RUN_ID": run_id, RELAY_ENV: "stdout", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", RANK0], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_relayed_calls_reach_the_run_as_direct_logging_would(tmp_path):
    client = MlflowClient()
    exp = client.get_experiment_by_name("test-relay") or client.get_experiment(client.create_experiment("test-relay"))
    run_id = client.create_run(exp.experiment_id).info.run_id
    RunLogger(run_id).log_metrics({"train/loss": 0.5}, step=30)  # an earlier task try logged step 30

    lines = _run_rank0(run_id)
    assert all(len(line.encode()) < 4096 for line in lines), "each line fits one atomic pipe write"
    receiver = RelayReceiver(run_id)
    try:
        rest = [line for line in lines if not receiver.handle(line)]
    finally:
        receiver.close()

    assert rest == ["RelayLogger", "step 30/30 | an ordinary progress line", "mlflow imported: False"]
    run = client.get_run(run_id)
    assert run.data.params == {f"p{i:03d}": "x" * 100 for i in range(100)}
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert loss == [(10, 0.1), (20, 0.2), (30, 0.5)], "replayed and already logged steps are skipped"
    assert sorted(m.value for m in client.get_metric_history(run_id, "fault/restarts")) == [1.0, 2.0]
    assert run.data.metrics["summary/wall_s"] == 3.5
    assert run.data.tags["checkpoint.local_path"] == "/ck/step_00000030"
    assert open(client.download_artifacts(run_id, "notes/rank0.txt", str(tmp_path))).read() == "rank 0 was here"
    assert any(k.startswith("system/") for k in run.data.metrics), "the receiver samples the system metrics"


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_without_the_relay_rank0_logs_directly():
    env = {**os.environ, "MLFLOW_RUN_ID": "anything", "PYTHONPATH": str(ROOT)}
    env.pop(RELAY_ENV, None)
    code = "from training.tracking.relay import logger_for; print(type(logger_for(True)).__name__, type(logger_for(False)).__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["RunLogger", "NullLogger"], out.stderr[-2000:]
