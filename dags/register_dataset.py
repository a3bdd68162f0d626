"""
# Register a dataset

Announces that new training data has landed. One task, **register**:

1. writes a fresh synthetic dataset into **Dataset folder** (or, with *Generate fresh data* off,
   takes the folder as it is: data someone dropped there);
2. runs the same Great Expectations data gate as training (bad data fails here, nothing retrains);
3. emits an event on the Asset **training_dataset** whose extra names the folder, its sha256
   fingerprint and row counts.

**distributed_training_on_data** is scheduled on that Asset: each event starts a training run on
the announced folder. Anything that writes data can announce it the same way (an `outlets=` task,
or `POST /api/v2/assets/events` on the REST API).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from training_airflow.assets import TRAINING_DATASET
from training_airflow.dataset_tasks import register_params


@dag(
    dag_id="register_dataset",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["training", "data"],
    params=register_params(),
    default_args={"owner": "ml-platform", "retries": 1, "retry_delay": timedelta(seconds=15),
                  "execution_timeout": timedelta(minutes=30)},
    doc_md=__doc__,
)
def register_dataset():
    @task(outlets=[TRAINING_DATASET])
    def register(params=None, outlet_events=None):
        from training_airflow.dataset_tasks import register_dataset as register_body

        extra = register_body(params)
        outlet_events[TRAINING_DATASET].extra = extra
        return extra

    register()


register_dataset()
