"""MLflow logging: one run per DAG run, written through ``MlflowClient`` (no global active run).

The run id travels as ``MLFLOW_RUN_ID`` and the store as ``MLFLOW_TRACKING_URI`` (MLflow's own
variable names). Only rank 0 logs (``RunLogger``); every other rank, and a process started by
hand without a run id, gets a ``NullLogger`` with the same methods.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

TAG_DAG_ID = "airflow.dag_id"
TAG_DAG_RUN_ID = "airflow.dag_run_id"


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def default_artifact_location(tracking_uri: str) -> str | None:
    """For a local SQLite store keep artifacts next to the database, not in the process's cwd."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        if not db.is_absolute():
            db = Path.cwd() / db
        return (db.parent / "artifacts").as_uri()
    return None


def get_or_create_experiment(name: str) -> str:
    import mlflow

    client = _client()
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=default_artifact_location(mlflow.get_tracking_uri()))
    except Exception:  # another process created it between our two calls
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def open_run(experiment: str, *, dag_id: str, dag_run_id: str, run_name: str | None = None,
             tags: dict[str, str] | None = None) -> str:
    """Return the MLflow run of this DAG run, creating it the first time only.

    Keyed by the ``airflow.dag_run_id`` tag, so a retried task (or a re-run of the first task)
    finds the same run instead of opening a second one.
    """
    client = _client()
    exp_id = get_or_create_experiment(experiment)
    found = find_runs(exp_id, dag_id=dag_id, dag_run_id=dag_run_id)
    if found:
        return found[0].info.run_id
    run = client.create_run(exp_id, run_name=run_name, tags={TAG_DAG_ID: dag_id, TAG_DAG_RUN_ID: dag_run_id, **(tags or {})})
    return run.info.run_id


def find_runs(experiment_id: str, *, dag_id: str, dag_run_id: str | None = None, status: str | None = None) -> list:
    """MLflow runs of a DAG (and of one of its DAG runs, and in one status, when given)."""
    def quoted(v: str) -> str:
        return "'" + v.replace("'", "") + "'"

    terms = [f"tags.`{TAG_DAG_ID}` = {quoted(dag_id)}"]
    if dag_run_id is not None:
        terms.append(f"tags.`{TAG_DAG_RUN_ID}` = {quoted(dag_run_id)}")
    if status is not None:
        terms.append(f"attributes.status = {quoted(status)}")
    return _client().search_runs([experiment_id], filter_string=" and ".join(terms), max_results=1000)


class RunLogger:
    """Logs to one existing MLflow run."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.client = _client()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # JSON for objects (model_args, dict Params), so a param reads back as what was set.
        items = [Param(k, (json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v))[:6000])
                 for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def log_metrics_once(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Like ``log_metrics``, but skip every metric that already has a value at ``step``: a
        retried or cleared task then leaves one point per step, not two. Returns what it logged."""
        new = {k: v for k, v in metrics.items()
               if not any(m.step == step for m in self.client.get_metric_history(self.run_id, k))}
        if new:
            self.log_metrics(new, step=step)
        return new

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)


class NullLogger:
    """Same methods as RunLogger, does nothing: for ranks other than 0 and runs without MLflow."""

    run_id = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_metrics_once(self, metrics: dict[str, float], step: int) -> dict[str, float]: return {}
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


def logger_for(is_main: bool) -> RunLogger | NullLogger:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    return RunLogger(run_id) if (is_main and run_id) else NullLogger()
