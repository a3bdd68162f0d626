"""``body_task``: a TaskFlow task that hands its upstream's XCom and the run's Params to a task
body of this package, imported only when the task runs, so parsing a DAG imports no task body
(nor the heavy libraries they import)."""

from __future__ import annotations

import importlib
from typing import Any

from airflow.sdk import task


def body_task(module: str, name: str) -> Any:
    """The task ``name`` calling ``training_airflow.<module>.<name>(params, upstream)``."""

    @task(task_id=name)
    def call(upstream: dict, params=None):
        return getattr(importlib.import_module(f"training_airflow.{module}"), name)(params, upstream)

    call.function.__doc__ = f"``training_airflow.{module}.{name}``"
    return call
