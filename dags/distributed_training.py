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

With **backend = kubernetes** the training runs on a cluster instead (`train` is skipped):
**create_rendezvous_service** (headless Service) -> **train_on_kubernetes** (Indexed Job of
`k8s_nnodes` pods, torchrun with the c10d rendezvous on pod 0) -> **upload_on_kubernetes** (a pod that
commits the checkpoint from the shared volume to the `s3://` store), and
**delete_rendezvous_service** whatever happened. `upload_checkpoint` then reads the commit back,
and `evaluate` and `report` run as on the local backend.

Trigger it with the form (every field explains itself), then open MLflow and compare runs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import TriggerRule, dag, task

from training_airflow import kubernetes, settings
from training_airflow.assets import TRAINING_DATASET
from training_airflow.params import training_params

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 1,
    "retry_delay": timedelta(seconds=15),
    "execution_timeout": timedelta(hours=2),
}


ON_DATA_DOC = """
# Distributed training when new data lands

The same pipeline as **distributed_training** (same tasks, same Params and defaults), scheduled on
the Asset **training_dataset** instead of a clock: every time `register_dataset` announces new data
that passed the data gate, one run trains on the folder the event names (`dataset_uri` in the
event's extra; the Param is the fallback) and the registry gate decides whether the new model
becomes the `champion`. Events that arrive while a run is active are collected into the next run.
"""


def pipeline():
    """The task wiring of a training run, shared by both DAGs below."""

    @task
    def validate_data(params=None, dag=None, run_id=None, triggering_asset_events=None):
        from training_airflow import tasks

        return tasks.validate_data(params, dag_id=dag.dag_id, dag_run_id=run_id,
                                   dataset_uri=tasks.dataset_from_events(triggering_asset_events))

    @task
    def train(handoff: dict, params=None):
        from training_airflow import tasks

        return tasks.train(params, handoff)

    @task.branch
    def choose_backend(opened: dict, params=None):
        if params["backend"] == "kubernetes":
            return ["create_rendezvous_service", "delete_rendezvous_service"]
        return "train"

    # Runs after whichever backend trained: `train` (local) or `upload_on_kubernetes`.
    @task(trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS)
    def upload_checkpoint(handoff: dict | None, opened: dict, params=None, ti=None):
        if params["backend"] == "kubernetes":  # the upload pod committed it; read the commit back
            return kubernetes.upload_checkpoint(params, opened,
                                                job=ti.xcom_pull(task_ids="train_on_kubernetes", key="job"))
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

    opened = validate_data()
    route = choose_backend(opened)
    trained = train(opened)

    # Kubernetes backend (docs/architecture.md): every argument comes from the run's Params.
    create_service = kubernetes.RendezvousServiceOperator(task_id="create_rendezvous_service", handoff=opened)
    train_on_k8s = kubernetes.TrainingJobOperator(
        task_id="train_on_kubernetes", handoff=opened,
        # The Job's activeDeadlineSeconds (Param k8s_active_deadline_s) is the real limit.
        execution_timeout=timedelta(days=30))
    upload_on_k8s = kubernetes.UploadPodOperator(task_id="upload_on_kubernetes", handoff=opened)
    delete_service = kubernetes.DeleteRendezvousServiceOperator(
        task_id="delete_rendezvous_service", handoff=opened, trigger_rule=TriggerRule.ALL_DONE)
    route >> [trained, create_service, delete_service]
    create_service >> train_on_k8s >> upload_on_k8s
    train_on_k8s >> delete_service

    uploaded = upload_checkpoint(trained, opened)
    upload_on_k8s >> uploaded
    report(evaluate(uploaded))


COMMON = dict(start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1, default_args=DEFAULT_ARGS)

# Schedule: TRAINING_SCHEDULE (cron or preset, `none` to switch it off); see docs/operations.md.
distributed_training = dag(dag_id="distributed_training", schedule=settings.training_schedule(),
                           tags=["training", "distributed", "mlflow"], params=training_params(), doc_md=__doc__,
                           **COMMON)(pipeline)
distributed_training_on_data = dag(dag_id="distributed_training_on_data", schedule=[TRAINING_DATASET],
                                   tags=["training", "distributed", "mlflow", "data-driven"], params=training_params(),
                                   doc_md=ON_DATA_DOC, **COMMON)(pipeline)

distributed_training()
distributed_training_on_data()
