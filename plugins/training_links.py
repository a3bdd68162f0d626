"""Airflow plugin of this project (code in plugins/training_airflow/links.py): the extra link
"MLflow run" on every task of every DAG, which opens the MLflow run of the task's DAG run, and a
listener that copies a DAG run's note into its MLflow run when the run ends. This file only
registers them (the plugin loader imports top-level files of plugins/, never training_airflow/:
see .airflowignore)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from training_airflow.links import MLflowRunLink, RunNoteListener


class TrainingLinks(AirflowPlugin):
    name = "training_links"
    global_operator_extra_links = [MLflowRunLink()]
    listeners = [RunNoteListener()]
