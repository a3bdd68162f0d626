"""Airflow plugin of this project (code in plugins/training_airflow/links.py): the extra link
"MLflow run" on every task of every DAG, which opens the MLflow run of the task's DAG run, and a
listener that copies a DAG run's note into its MLflow run when the run ends, and the api-server's
check that refuses a trigger whose conf names something that is not a Param of the DAG
(training_airflow/conf_check.py). This file only registers them (the plugin loader imports
top-level files of plugins/, never training_airflow/: see .airflowignore)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from training_airflow.conf_check import ConfCheck
from training_airflow.links import MLflowRunLink, RunNoteListener


class TrainingLinks(AirflowPlugin):
    name = "training_links"
    global_operator_extra_links = [MLflowRunLink()]
    listeners = [RunNoteListener()]
    # In the api-server: a trigger whose conf names something that is not a Param gets 400
    # (training_airflow/conf_check.py), from the REST API and from the web UI's trigger form.
    fastapi_root_middlewares = [{"middleware": ConfCheck, "args": [], "kwargs": {}, "name": "Unknown conf keys refused"}]
