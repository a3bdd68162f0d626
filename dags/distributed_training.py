"""
# Distributed training

One run of this DAG trains one model and records everything in **one MLflow run**:

1. **validate_data** - opens the MLflow run of this DAG run (a retry re-opens the same one), checks the
   parameters, and runs the Great Expectations data gate on the dataset. Bad data stops the run here:
   no rank starts.
2. **train** - starts `torchrun --nproc-per-node <world_size>` (DDP over gloo on CPU, nccl on GPUs).
   Rank 0 logs `train/loss`, `perf/samples_per_s`, `comm/s_per_step` to MLflow. Checkpoints every
   K steps; a retried task resumes from the latest complete one.
3. **upload_checkpoint** - commits the final checkpoint to the store (`file://` or `s3://`): objects,
   then `manifest.json` with every sha256, then the `latest` pointer.
4. **evaluate** - fetches the checkpoint back, verifies it against the manifest, scores the
   validation split (`eval/loss`, `eval/accuracy`).
5. **report** - closes the MLflow run and records the orchestration overhead.

Trigger it with the form (every field explains itself), then open MLflow and compare runs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from training_airflow.params import training_params

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 1,
    "retry_delay": timedelta(seconds=15),
    "execution_timeout": timedelta(hours=2),
}


@dag(
    dag_id="distributed_training",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["training", "distributed", "mlflow"],
    params=training_params(),
    default_args=DEFAULT_ARGS,
    doc_md=__doc__,
)
def distributed_training():
    @task
    def validate_data(params=None, dag=None, run_id=None):
        from training_airflow import tasks

        return tasks.validate_data(params, dag_id=dag.dag_id, dag_run_id=run_id)

    @task
    def train(handoff: dict, params=None):
        from training_airflow import tasks

        return tasks.train(params, handoff)

    @task
    def upload_checkpoint(handoff: dict, params=None):
        from training_airflow import tasks

        return tasks.upload_checkpoint(params, handoff)

    @task
    def evaluate(handoff: dict, params=None):
        from training_airflow import tasks

        return tasks.evaluate(params, handoff)

    @task
    def report(handoff: dict, params=None, dag_run=None):
        from training_airflow import tasks

        return tasks.report(params, handoff, dag_run_start=dag_run.start_date)

    report(evaluate(upload_checkpoint(train(validate_data()))))


distributed_training()
