"""
# Training benchmark

A sweep over **world size x strategy x precision x gradient compression** on one model and
dataset, the same as `python -m training bench`: one MLflow **parent run** per DAG run, one
**child run** per grid point (nested under the parent in the MLflow UI).

1. **open_parent** - checks the grid (points the trainer would refuse are skipped, with the
   reason in the log) and opens the parent run (a retry finds the same one).
2. **sweep** - trains every point with `torchrun`; a retry skips the points already finished.
3. **report** - logs the comparison report (table, plots of throughput, scaling, communication,
   loss and time to target) to the parent run under `comparison/` and closes it.

Choose the grid in the trigger form; `python -m training compare` gives the same figures for any runs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from training_airflow.bench_tasks import bench_params
from training_airflow.wiring import body_task


@dag(
    dag_id="training_benchmark",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    params=bench_params(),
    tags=["training", "benchmark"],
    doc_md=__doc__,
    default_args={"owner": "ml-platform", "retries": 1, "retry_delay": timedelta(seconds=15),
                  "execution_timeout": timedelta(hours=6)},
    max_active_runs=1,  # points of two sweeps on one machine would disturb each other's timings
)
def training_benchmark():
    @task
    def open_parent(params=None, dag=None, run_id=None):
        from training_airflow import bench_tasks

        return bench_tasks.open_parent(params, dag_id=dag.dag_id, dag_run_id=run_id)

    sweep = body_task("bench_tasks", "sweep")
    report = body_task("bench_tasks", "report")

    report(sweep(open_parent()))


training_benchmark()
