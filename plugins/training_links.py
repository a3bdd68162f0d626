"""Airflow plugin of this project: the extra link "MLflow run" on every task of every DAG, which
opens the MLflow run of the task's DAG run (plugins/training_airflow/links.py). The code lives in
the package; this file only registers it (the plugin loader imports top-level files of plugins/,
never training_airflow/: see .airflowignore)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from training_airflow.links import MLflowRunLink


class TrainingLinks(AirflowPlugin):
    name = "training_links"
    global_operator_extra_links = [MLflowRunLink()]
