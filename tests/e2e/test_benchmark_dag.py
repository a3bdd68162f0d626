"""The benchmark sweep DAG for real (dag.test() on SQLite, torchrun over gloo, MLflow on SQLite):
a 2-point grid gives two child runs under one parent run, and the comparison report of exactly
those children is logged to the parent."""

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import load_dag


@pytest.mark.slow
def test_two_point_sweep_nests_children_and_logs_the_report(airflow_db, dataset):
    conf = {"dataset_uri": str(dataset), "experiment": "bench-e2e", "world_sizes": [1, 2], "strategies": ["ddp"],
            "precisions": ["fp32"], "comm_hooks": ["none", "bf16"], "steps": 20, "batch_size": 32, "log_every": 5}
    dag_run = load_dag("training_benchmark").test(run_conf=conf)
    states = {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}
    assert states == {"open_parent": "success", "sweep": "success", "report": "success"}

    client = MlflowClient()
    exp = client.get_experiment_by_name("bench-e2e")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("airflow.dag_run_id") == dag_run.run_id]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    # bf16 compression needs CUDA: those two points are skipped on this CPU machine, not failed.
    assert sorted(r.info.run_name for r in children) == ["ws1-ddp-fp32-none", "ws2-ddp-fp32-none"]
    assert all(r.info.status == "FINISHED" for r in children)
    assert sorted(r.data.params["world_size"] for r in children) == ["1", "2"]
    for r in children:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")] == [5, 10, 15, 20]
        # The first, warm-up interval is left out of the speed series (its figures: the run summary).
        assert [m.step for m in client.get_metric_history(r.info.run_id, "perf/samples_per_s")] == [10, 15, 20]

    artifacts = {a.path for a in client.list_artifacts(parent, "comparison")}
    assert {"comparison/report.md", "comparison/report.html", "comparison/scaling.png",
            "comparison/step_time.png", "comparison/loss.png"} <= artifacts
    md = client.download_artifacts(parent, "comparison/report.md")
    text = open(md).read()
    assert all(r.info.run_id in text for r in children)
