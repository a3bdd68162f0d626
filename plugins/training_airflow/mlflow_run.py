"""The MLflow run of a DAG run, as the tasks see it: opened (or, on a retry, re-opened) by the
``open_run`` task, then reached by its id from every later task (``run_logger``)."""

from __future__ import annotations

from typing import Any

from training_airflow import settings


def run_logger(run_id: str) -> Any:
    """The MLflow run of this DAG run (``training.tracking.run.RunLogger``)."""
    settings.ensure_tracking_uri()
    from training.tracking.run import RunLogger

    return RunLogger(run_id)
