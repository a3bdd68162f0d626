"""Five DAG runs at once through the live scheduler (LocalExecutor, SQLite metadata DB, SQLite
MLflow store): all succeed, their torchrun groups never clash on a port, nothing reports
`database is locked`, and five MLflow runs hold complete metrics."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

TRAIN, RUNS, STEPS = "distributed_training", 5, 30


@pytest.mark.budget(480, reason="five full DAG runs at once on the live stack, the point of the test")
def test_five_runs_at_once_all_succeed_with_complete_records(live_airflow, dataset, tmp_root):
    af = live_airflow
    af.wait_for_dags(TRAIN)
    af.unpause(TRAIN)
    # The stack's logs from here on: other tests on this stack write them too (a scheduler
    # restarted by test_live_faults can log its own shutdown's lock error before this test starts).
    parts = {part: af.home / f"{part}.log" for part in ("scheduler", "api-server")}
    start = {part: path.stat().st_size if path.exists() else 0 for part, path in parts.items()}
    base = {"dataset_uri": str(dataset), "experiment": "live-load", "world_size": 2, "steps": STEPS,
            "checkpoint_every": 15, "eval_every": 15, "store_uri": (tmp_root / "load-store").as_uri()}
    run_ids = []
    for seed in range(RUNS):  # different Params: a seed each
        run_ids.append(af.trigger(TRAIN, {**base, "seed": seed}))
    for run_id in run_ids:
        run = af.wait_for_run(TRAIN, run_id, timeout=1800)
        states = af.task_states(TRAIN, run_id)
        failed = [t for t, st in states.items() if st == "failed"]
        assert run["state"] == "success", (run_id, states, [af.task_log(TRAIN, run_id, t)[-3000:] for t in failed])

    client = MlflowClient()
    exp = client.get_experiment_by_name("live-load")
    runs = {r.data.tags["airflow.dag_run_id"]: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == sorted(run_ids)
    for run_id, run in runs.items():
        assert run.info.status == "FINISHED"
        loss = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert loss == list(range(10, STEPS + 1, 10)), (run_id, loss)
        assert {"eval/accuracy", "perf/samples_per_s"} <= set(run.data.metrics)
        assert {"summary.dag_wall_s", "summary.goodput"} <= set(run.data.tags), sorted(run.data.tags)
    logs = "\n".join(af.task_log(TRAIN, run_id, task) for run_id in run_ids for task in ("train", "evaluate"))
    for part, path in parts.items():
        with path.open("rb") as f:
            f.seek(start[part])
            logs += f.read().decode(errors="replace")
    assert "database is locked" not in logs
    assert "Address already in use" not in logs and "EADDRINUSE" not in logs
