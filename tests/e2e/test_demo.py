"""`make demo`, the README's main command, as a user runs it: from a shell whose PATH does not hold
the project's virtual environment, with a fresh Airflow home, MLflow store and data folder (so it
makes the dataset and migrates the database itself). It must end with a successful DAG run and
print where to look."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_make_demo_runs_the_pipeline_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "TRAINING_"))}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=str(tmp_path), AIRFLOW_HOME=str(tmp_path / "airflow"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", TRAINING_VAR_DIR=str(tmp_path / "var"))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["make", "-s", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "==> making the demo dataset" in out
    assert re.search(r"DAG run      : \S+  state=\S*success", out), out[-3000:]
    accuracy = float(re.search(r"Evaluation   : accuracy ([0-9.]+)", out)[1])
    assert accuracy >= 0.70, out[-3000:]  # chance is 0.25, the data's ceiling 0.925
    tasks = dict(re.findall(r"(\w+) ([0-9.]+)s", re.search(r"Tasks        : (.*)", out)[1]))
    assert set(tasks) == {"open_run", "validate_data", "tokenize", "train", "upload_checkpoint", "evaluate", "register", "report"}, out[-3000:]
    assert re.search(r"Target       : eval/accuracy 0\.8 reached at step \d+, [\d.]+s after training started", out)
    # rank 0's start-up reached the MLflow run through the train task (the relay)
    assert re.search(r"Start-up     : rank 0 at its first step [0-9.]+s after its process started \(imports", out)
    assert (tmp_path / "var" / "store").is_dir(), "the checkpoint was committed to the default store"
    name = re.search(r"MLflow run   : (mlp-ddp-fp32-2ranks-(\d+)steps)  \(\w{32}\)", out)
    assert name, out[-3000:]  # a readable name: what the run trains
    # Every task's log is where the Airflow UI reads it (make airflow-up on the same home shows it).
    run = next((tmp_path / "airflow" / "logs" / "dag_id=distributed_training").glob("run_id=*"))
    logs = {}
    for task in ("open_run", "validate_data", "tokenize", "train", "upload_checkpoint", "evaluate", "register", "report"):
        logs[task] = [json.loads(line) for line in (run / f"task_id={task}" / "attempt=1.log").read_text().splitlines()]
        assert logs[task] and all({"timestamp", "level", "event"} <= set(r) for r in logs[task]), task
    steps = name[2]
    assert any(r["event"].startswith(f"step {steps}/{steps} | loss") for r in logs["train"]), logs["train"][-20:]
