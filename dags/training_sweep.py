"""
# Training sweep

A hyperparameter search over the pipeline's own tasks: **one MLflow parent run** for the sweep,
one **child run per trial** (nested under it, tagged with its trial number and sampled values, so
MLflow's compare view lines the trials up), and **one Optuna study** that records every trial.

1. **open_sweep** - checks the base run's Params and the search (every value of the space against
   the trainer's rules, the policy's bounds), then opens the parent run and the study.
2. **validate_data** and **tokenize** - the data gate once for the whole sweep.
3. **lanes** / **trials** - `max_parallel_trials` mapped lanes side by side; each trains trials one
   after another (torchrun, commit, evaluate) until the study has `trials`. With `pruner=asha` a
   trial that is not in the best half at an evaluation rung stops there, keeps its checkpoint and is
   recorded as **pruned**. A failing trial fails alone; a retried lane resumes its interrupted
   trial and never trains a finished one again (the study is the record). Once a lane has ended,
   its name in the grid says how each of its trials ended (`lane 0: trial 0 complete, trial 2
   pruned at step 10`).
4. **report** - the table of trials, the optimization history and parallel-coordinates plots and
   the steps spent in the parent run; the best trial's model goes through the registry gate.

Trigger it with the form: the base run's fields, then the **Sweep** section.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from training_airflow import lifecycle
from training_airflow.sweep_tasks import sweep_params
from training_airflow.wiring import body_task


@dag(
    dag_id="training_sweep",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params=sweep_params(),
    tags=["training", "sweep", "mlflow"],
    doc_md=__doc__,
    default_args={"owner": "ml-platform", "retries": 1, "retry_delay": timedelta(seconds=15),
                  "execution_timeout": timedelta(hours=12), "on_failure_callback": lifecycle.on_failure,
                  "on_retry_callback": lifecycle.on_retry, "on_success_callback": lifecycle.on_success},
    max_active_runs=1,
)
def training_sweep():
    @task
    def open_sweep(params=None, dag=None, run_id=None, dag_run=None):
        from training_airflow import sweep_tasks

        return sweep_tasks.open_sweep(params, dag_id=dag.dag_id, dag_run_id=run_id, dag_run=dag_run)

    @task
    def lanes(validated: dict, params=None) -> list:
        from training_airflow import sweep_tasks

        return sweep_tasks.lanes(params, validated)

    @task(map_index_template="{{ lane_name }}")
    def trials(lane: dict, params=None) -> dict:
        from airflow.sdk import get_current_context

        from training_airflow import sweep_tasks

        context = get_current_context()  # the grid names each mapped task: the lane, then how its trials ended
        context["lane_name"] = f"lane {lane['lane']}"
        ran = sweep_tasks.run_lane(params, lane)
        context["lane_name"] = sweep_tasks.lane_label(ran)
        return ran

    validated = body_task("tasks", "tokenize")(body_task("tasks", "validate_data")(open_sweep()))
    ran = trials.expand(lane=lanes(validated))
    report = body_task("sweep_tasks", "report")(validated)
    ran >> report


training_sweep()
