"""A failed run leaves a true record in its MLflow run: which task, which try, why in one line, the
tail of the task's output, and the status FAILED; a later success puts it back; a cancelled DAG
run ends KILLED. Real Airflow (dag.test on SQLite), real torchrun ranks, a real MLflow store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import load_dag


def _mlflow_run(experiment: str, dag_run_id: str):
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run_id}'")
    return client, run


@pytest.mark.slow
def test_a_rank_killed_in_every_try_fails_the_run_with_the_reason(airflow_db, dataset, tmp_path, monkeypatch):
    # Rank 1 SIGKILLs itself after step 3 in every launch: both tries of `train` fail.
    monkeypatch.setenv("TRAINING_FAULT_KILL_AT_STEP", "3:1")
    conf = {"dataset_uri": str(dataset), "experiment": "e2e-fail", "steps": 20, "checkpoint_every": 0,
            "eval_every": 0, "store_uri": (tmp_path / "store").as_uri()}
    dag_run = load_dag("distributed_training").test(run_conf=conf)

    states = {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}
    assert states["train"] == "failed" and states["evaluate"] == "upstream_failed", states
    client, run = _mlflow_run("e2e-fail", dag_run.run_id)
    tags = run.data.tags
    assert run.info.status == "FAILED"
    assert (tags["failure.task"], tags["failure.try"]) == ("train", "2")
    # torchrun's root cause, then what the surviving rank was doing when its peer died.
    assert tags["failure.reason"].startswith("torchrun exited with code 1: rank 1 exited with -9 (Signal 9 (SIGKILL)")
    assert "rank 0/2: forward/backward failed at step" in tags["failure.reason"]
    # Which rank died (no error of its own), where its peer was waiting, each rank's last step.
    assert tags["failure.rank"] == "1 (raised nothing: killed or hung)"
    assert tags["failure.collective"] == "forward/backward"
    assert tags["failure.last_steps"] == "rank 0: 3, rank 1: 3"
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "failures")}
    assert logs == {"failures/train-try1.log", "failures/train-try2.log", "failures/ranks.json"}
    tail = open(client.download_artifacts(run.info.run_id, "failures/train-try2.log")).read()
    assert "fault injection: rank 1 SIGKILLs itself after step 3" in tail


def test_a_success_after_a_failure_clears_the_record(tmp_root):
    """The callbacks as Airflow calls them (a task instance, its params, the exception), against the
    real MLflow store: a retry that succeeds puts the run back to RUNNING without the failure tags."""
    from training.tracking.run import open_run
    from training_airflow import lifecycle, settings

    settings.ensure_tracking_uri()
    run_id = open_run("e2e-recover", dag_id="distributed_training", dag_run_id="manual__recover")
    ti = SimpleNamespace(dag_id="distributed_training", run_id="manual__recover", task_id="evaluate", try_number=1)
    context = {"params": {"experiment": "e2e-recover"}, "ti": ti,
               "exception": RuntimeError("checkpoint upload failed: bucket 'x' does not exist\nmore detail")}
    lifecycle.on_retry(context)
    client = MlflowClient()
    client.set_tag(run_id, "failure.rank", "1 (raised nothing: killed or hung)")  # as the launcher records it
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING", "a retry follows: the run is still going"
    assert run.data.tags["failure.reason"] == "RuntimeError: checkpoint upload failed: bucket 'x' does not exist"

    ti.try_number = 2
    lifecycle.on_failure(context)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure.try"] == "2"

    ti.try_number = 3  # a person cleared the task and it succeeded
    lifecycle.on_success({**context, "exception": None})
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert not {k for k in run.data.tags if k.startswith("failure.")}


def test_cancelled_and_deleted_dag_runs_end_killed(tmp_root, monkeypatch):
    """Airflow calls no callback when a DAG run is marked failed or deleted; the next run's
    open_run asks the API server for the state of each RUNNING run's DAG run (played here by
    the Task SDK call it makes, answering as the server does: a state, or an error for a missing run)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    from training.tracking.run import open_run
    from training_airflow import lifecycle, settings

    settings.ensure_tracking_uri()
    ids = {name: open_run("e2e-cancel", dag_id="distributed_training", dag_run_id=name)
           for name in ("marked_failed", "deleted", "still_running", "current")}
    answers = {"marked_failed": "failed", "still_running": "running", "current": "running"}

    def state(dag_id, run_id):
        if run_id not in answers:
            raise RuntimeError("API server error: DAGRUN_NOT_FOUND")
        return answers[run_id]

    monkeypatch.setattr(RuntimeTaskInstance, "get_dagrun_state", staticmethod(state))
    exp = MlflowClient().get_experiment_by_name("e2e-cancel").experiment_id
    killed = lifecycle.reconcile(exp, dag_id="distributed_training", current_run_id="current")
    assert sorted(killed) == sorted([ids["marked_failed"], ids["deleted"]])
    status = {name: MlflowClient().get_run(i).info.status for name, i in ids.items()}
    assert status == {"marked_failed": "KILLED", "deleted": "KILLED", "still_running": "RUNNING", "current": "RUNNING"}
    assert MlflowClient().get_run(ids["deleted"]).data.tags["failure.reason"] == "cancelled: the DAG run was deleted"
