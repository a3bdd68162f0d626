"""The sweep DAG for real (dag.test() on SQLite, torchrun over gloo, MLflow and the Optuna study
on SQLite): a 4-point grid over lr x hidden with ASHA, two lanes. The trials are child runs of one
parent run, tagged with their values; a trial with a hopeless learning rate is pruned at its first
rung and keeps its checkpoint; the best trial's model is registered; the study is the record, so a
second run of a lane trains nothing again."""

import json

import optuna
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import load_dag


def _states(dag_run):
    return {(ti.task_id, ti.map_index): str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}


@pytest.mark.slow
def test_a_grid_sweep_prunes_the_hopeless_trial_and_registers_the_best(airflow_db, dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_SWEEP_STORAGE", f"sqlite:///{tmp_path / 'sweeps.db'}")
    conf = {"dataset_uri": str(dataset), "experiment": "sweep-e2e", "store_uri": (tmp_path / "s").as_uri(),
            "steps": 40, "eval_every": 10, "batch_size": 32, "log_every": 10, "world_size": 1,
            "search_space": {"lr": [1e-2, 1e-7], "hidden": [16, 32]}, "sampler": "grid", "pruner": "asha",
            "trials": 4, "max_parallel_trials": 2, "objective": "eval/loss", "registered_model": "sweep-e2e"}
    dag_run = load_dag("training_sweep").test(run_conf=conf)
    states = _states(dag_run)
    assert set(states.values()) == {"success"}, states
    assert {k for k in states if k[0] == "trials"} == {("trials", 0), ("trials", 1)}

    client = MlflowClient()
    exp = client.get_experiment_by_name("sweep-e2e")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("airflow.dag_run_id") == dag_run.run_id)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and len(children) == 4
    assert all(r.info.status == "FINISHED" for r in children)
    grid = sorted((float(r.data.params["lr"]), int(r.data.params["hidden"])) for r in children)
    assert grid == [(1e-7, 16), (1e-7, 32), (1e-2, 16), (1e-2, 32)]  # every point of the grid, once
    for r in children:
        assert r.data.tags["sweep.param.lr"] == r.data.params["lr"]

    study = optuna.load_study(study_name=parent.info.run_id, storage=f"sqlite:///{tmp_path / 'sweeps.db'}")
    by_state = {}
    for t in study.trials:
        by_state.setdefault(t.state.name, []).append(t)
    # lr=1e-7 barely moves: at the 10-step rung it is behind a trial that learns, and is pruned there
    # (the first trial to reach a rung is never pruned: nothing to compare with yet).
    pruned = by_state.get("PRUNED", [])
    assert pruned and all(t.params["lr"] == 1e-7 and t.user_attrs["steps"] < 40 for t in pruned), \
        [(t.number, t.state.name, t.params, t.user_attrs.get("steps")) for t in study.trials]
    assert all(t.user_attrs["steps"] == 40 for t in by_state["COMPLETE"])
    best = study.best_trial
    assert best.params["lr"] == 1e-2

    summary = client.get_run(parent.info.run_id).data
    spent = sum(t.user_attrs["steps"] for t in study.trials)
    assert summary.metrics["sweep/steps_spent"] == spent < summary.metrics["sweep/steps_without_pruning"] == 160
    assert summary.metrics["sweep/trials_pruned"] == len(pruned)
    assert summary.tags["sweep.best_run_id"] == best.user_attrs["mlflow_run_id"]
    table = open(client.download_artifacts(parent.info.run_id, "sweep/trials.md")).read()
    assert all(r.info.run_id in table for r in children) and "pruned" in table
    assert {"sweep/optimization_history.png", "sweep/parallel_coordinates.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    # The pruned trial's checkpoint is kept: its model was committed at the rung and evaluated.
    for t in pruned:
        assert t.user_attrs["scored"]["eval_step"] == t.user_attrs["steps"]
    version = client.get_model_version_by_alias("sweep-e2e", "champion")
    assert version.run_id == best.user_attrs["mlflow_run_id"]

    # The study is the record: a lane run again finds every trial finished and trains none.
    from training_airflow import sweep_tasks

    lane = {"mlflow_run_id": parent.info.run_id, "study": parent.info.run_id, "dataset_uri": str(dataset),
            "dataset_fingerprint": "", "lane": 0}
    params = {**load_dag("training_sweep").params.dump(), **conf}
    assert sweep_tasks.run_lane(params, lane) == {"lane": 0, "trials": []}
    assert len(optuna.load_study(study_name=parent.info.run_id, storage=f"sqlite:///{tmp_path / 'sweeps.db'}").trials) == 4
    json.dumps(summary.metrics)
