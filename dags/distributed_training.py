"""
# Distributed training

One run trains one model and records everything in **one MLflow run**, linked both ways (the link
**MLflow run** on every task; the run's description links back here):

1. **open_run** - checks the parameters, then opens the MLflow run (a retry re-opens the same one).
2. **validate_data** - the data gate on every split, and the model against the data: bad data stops here.
3. **tokenize** - text only (`text_column`): the token windows the ranks read, made once per data,
   tokenizer and `seq_len`; a table goes on as it came.
4. **train and commit**, the backend's task group: *local* (**train**: `torchrun` on the worker,
   then **upload_checkpoint**) or *kubernetes* (an Indexed Job of `k8s_nnodes` pods). By default the
   ranks commit every checkpoint straight to the store; a retry resumes from the newest that verifies.
5. **evaluate** - verifies the final checkpoint against its manifest and scores the validation split.
6. **register** - registers the model; it takes the `champion` alias if it beats the current one.
7. **report** - records the orchestration overhead, draws the run's plots, closes the MLflow run.

Trigger it with the form (every field explains itself), then open MLflow and compare runs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from training_airflow import backends, lifecycle, policy, settings
from training_airflow.assets import TRAINING_DATASET
from training_airflow.params import training_params
from training_airflow.wiring import body_task

DEFAULT_ARGS = {
    "owner": "ml-platform",
    "retries": 1,
    "retry_delay": timedelta(seconds=15),
    "execution_timeout": timedelta(hours=2),
    # The MLflow run follows: failure tags and the log tail on a failed try, FAILED when it is final,
    # back to RUNNING when a retry or a cleared task succeeds (plugins/training_airflow/lifecycle.py).
    "on_failure_callback": lifecycle.on_failure,
    "on_retry_callback": lifecycle.on_retry,
    "on_success_callback": lifecycle.on_success,
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
    def open_run(params=None, dag=None, run_id=None, dag_run=None, triggering_asset_events=None):
        from training_airflow import tasks

        return tasks.open_run(params, dag_id=dag.dag_id, dag_run_id=run_id, dag_run=dag_run,
                              dataset_uri=tasks.dataset_from_events(triggering_asset_events))

    validate_data = body_task("tasks", "validate_data")
    tokenize = body_task("tasks", "tokenize")
    evaluate = body_task("tasks", "evaluate")
    register = body_task("tasks", "register")

    @task
    def report(registered: dict, params=None, dag_run=None):
        from training_airflow import tasks

        return tasks.report(params, registered, dag_run_start=dag_run.start_date)

    # The backend's task group (backends/): trains and commits the final checkpoint to the store.
    handoff = backends.train_and_commit(tokenize(validate_data(open_run())))
    report(register(evaluate(handoff)))


# The policy's wall-clock ceiling (TRAINING_POLICY; none by default) ends a run that takes longer.
WALL_CLOCK_S = policy.load().policy.form_maximum("wall_clock_s")
COMMON = dict(start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=settings.max_active_runs(),
              default_args=DEFAULT_ARGS, dagrun_timeout=timedelta(seconds=WALL_CLOCK_S) if WALL_CLOCK_S else None)

# Schedule: TRAINING_SCHEDULE (cron or preset, `none` to switch it off); see docs/operations.md.
distributed_training = dag(dag_id="distributed_training", schedule=settings.training_schedule(),
                           tags=["training", "distributed", "mlflow"], params=training_params(), doc_md=__doc__,
                           **COMMON)(pipeline)
distributed_training_on_data = dag(dag_id="distributed_training_on_data", schedule=[TRAINING_DATASET],
                                   tags=["training", "distributed", "mlflow", "data-driven"], params=training_params(),
                                   doc_md=ON_DATA_DOC, **COMMON)(pipeline)

distributed_training()
distributed_training_on_data()
