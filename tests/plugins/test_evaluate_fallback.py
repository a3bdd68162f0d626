"""The evaluate task falls back visibly: a real checkpoint from a real torchrun run, committed twice to
the store (step 5, and the same model as a newer step 10 whose weights file is then altered), then
the `evaluate` task body: it scores step 5, warns in the task log, tags the MLflow run with the
reason and the step used, and records the evaluation next to the checkpoint it used."""

import json
import logging
import shutil

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run_torchrun
from training.checkpoint.commit import EVAL_FILE, upload_checkpoint


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_evaluate_task_falls_back_and_says_so(dataset, tmp_path, capfd, caplog):
    caplog.set_level(logging.WARNING, logger="training_airflow.tasks")
    out = run_torchrun(1, [f"dataset_uri={dataset}", f"checkpoint_dir={tmp_path / 'ckpt'}", "steps=5",
                           "checkpoint_every=5", f"output_dir={tmp_path / 'out'}"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    step5 = tmp_path / "ckpt" / "step_00000005"
    step10 = tmp_path / "copy" / "step_00000010"
    shutil.copytree(step5, step10)
    manifest = json.loads((step10 / "manifest.json").read_text())
    (step10 / "manifest.json").write_text(json.dumps({**manifest, "step": 10}))

    from training.tracking.run import open_run
    from training_airflow import settings, tasks

    settings.ensure_tracking_uri()
    run_id = open_run("fallback", dag_id="distributed_training", dag_run_id="manual__fallback-test")
    store = tmp_path / "store"
    for ck in (step5, step10):
        upload_checkpoint(ck, store.as_uri(), experiment="fallback", run_id=run_id)
    weights = store / "fallback" / run_id / "step_00000010" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))

    params = {"dataset_uri": str(dataset), "experiment": "fallback", "store_uri": store.as_uri(),
              "aws_conn_id": None, "retention_keep_last": 3}
    # Keep the task logger's records whatever logging setup earlier tests in this process left
    # behind (Airflow's dictConfig can disable loggers created before it ran).
    records: list[logging.LogRecord] = []
    keep = logging.Handler(level=logging.WARNING)
    keep.emit = records.append
    task_log = logging.getLogger("training_airflow.tasks")
    was_disabled, task_log.disabled = task_log.disabled, False
    task_log.addHandler(keep)
    try:
        result = tasks.evaluate(params, {"mlflow_run_id": run_id, "final_step": 10, "dataset_fingerprint": "x",
                                         "dataset_uri": str(dataset)})
    finally:
        task_log.removeHandler(keep)
        task_log.disabled = was_disabled

    reason = "step_00000010/model.safetensors does not match its manifest sha256; falling back to an older checkpoint"
    # A warning of the task's logger. Where it is rendered depends on whether Airflow's structlog
    # setup has already run in this process (then it is printed) or not (then it is a log record).
    printed = capfd.readouterr()
    rendered = any("warning" in line and f"checkpoint fallback: {reason}" in line and "training_airflow.tasks" in line
                   for line in (printed.out + printed.err).splitlines())
    recorded = any(r.levelno == logging.WARNING and r.name == "training_airflow.tasks"
                   and f"checkpoint fallback: {reason}" in r.getMessage() for r in [*records, *caplog.records])
    assert rendered or recorded
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["checkpoint.fallback"] == reason and tags["checkpoint.evaluated"] == "step_00000005"
    assert 0.0 <= result["eval_accuracy"] <= 1.0
    evaluated = json.loads((store / "fallback" / run_id / "step_00000005" / EVAL_FILE).read_text())
    assert evaluated["eval/accuracy"] == result["eval_accuracy"]
    # Retention kept both: the newest is what `latest` names, the older is within the last 3.
    assert sorted(p.name for p in (store / "fallback" / run_id).iterdir() if p.is_dir()) == ["step_00000005", "step_00000010"]
