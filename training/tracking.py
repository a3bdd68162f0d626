"""MLflow logging: one run per DAG run, written through ``MlflowClient`` (no global active run).

The run id travels as ``MLFLOW_RUN_ID`` and the store as ``MLFLOW_TRACKING_URI`` (MLflow's own
variable names). Only rank 0 logs (``RunLogger``); every other rank, and a process started by
hand without a run id, gets a ``NullLogger`` with the same methods.

When the launching process already holds an MLflow client (the local backend's ``train`` task)
it sets ``TRAINING_MLFLOW_RELAY=stdout``: rank 0 then gets a ``RelayLogger``, which writes each
call as one line on stdout, and the launcher's ``RelayReceiver`` applies the lines to the run.
Rank 0 never imports MLflow, pandas or SQLAlchemy nor opens a second connection to the store
(1.3-2.3 s of every rank group's start-up on a 2-core machine, while the other ranks wait), and
the run gets the same params, metrics and tags. Pods and runs by hand log directly.
"""

from __future__ import annotations

import json
import os
import sys
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

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
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


RELAY_ENV = "TRAINING_MLFLOW_RELAY"
RELAY_PREFIX = "@@mlflow "
_LINE_BYTES = 3500  # below PIPE_BUF (4096): one write() per line, never interleaved with another rank's


class RelayLogger:
    """Rank 0's logger when the launcher relays (``TRAINING_MLFLOW_RELAY=stdout``): every public
    ``RunLogger`` method, called here, becomes one ``@@mlflow {"call": name, "args": [...],
    "kwargs": {...}}`` line on stdout, which ``RelayReceiver`` replays on its ``RunLogger`` (so a
    method added to ``RunLogger`` is relayed without a change here). Metrics logged through
    ``metrics.OnceLogger`` are sent as ``log_metrics_once``: the receiving end, which can read the
    run, skips steps the run already has. ``run_id`` stays None: the launcher samples the system
    metrics. Calls whose one argument is a mapping of independent keys (params, tags, metrics) are
    split so that every line stays under PIPE_BUF and is written by one ``write()``."""

    run_id = None
    skips_logged_steps = True
    SPLITTABLE = ("log_params", "set_tags", "log_metrics", "log_metrics_once")

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "finish" or not callable(getattr(RunLogger, name, None)):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._relay(name, args, kwargs)

    def log_metrics_once(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        self._relay("log_metrics_once", (metrics,), {"step": step})
        return metrics

    def finish(self, status: str = "FINISHED") -> None:  # the task owns the run's status
        ...

    def _relay(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        if name in self.SPLITTABLE and len(args) == 1 and isinstance(args[0], dict):
            for chunk in _chunks(args[0]):
                self._send(name, (chunk,), kwargs)
        else:
            self._send(name, args, kwargs)

    @staticmethod
    def _send(name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        line = json.dumps({"call": name, "args": list(args), "kwargs": kwargs}, separators=(",", ":"), default=str)
        sys.stdout.flush()  # keep the order with the progress lines printed before
        os.write(1, (RELAY_PREFIX + line + "\n").encode())


def _chunks(items: dict[str, Any]):
    """``items`` in pieces whose JSON stays under ``_LINE_BYTES`` (one item alone may exceed it)."""
    chunk: dict[str, Any] = {}
    for k, v in items.items():
        if chunk and len(json.dumps({**chunk, k: v}, default=str)) > _LINE_BYTES:
            yield chunk
            chunk = {}
        chunk[k] = v
    if chunk:
        yield chunk


class RelayReceiver:
    """The launcher's end of ``RelayLogger``: ``handle(line)`` replays a relayed call on the run
    (and says it did), other lines are the caller's. ``log_metrics_once`` goes through
    ``metrics.OnceLogger``, which reads the run's logged steps once per metric (an earlier task
    try's too) and skips the steps a restarted rank group replays. Samples the system metrics
    while it is open."""

    def __init__(self, run_id: str, *, system_metrics: bool = True) -> None:
        from training.metrics import OnceLogger, start_system_metrics

        self.logger = RunLogger(run_id)
        self.once = OnceLogger(self.logger)
        self.system_metrics = start_system_metrics(run_id) if system_metrics else None

    def handle(self, line: str) -> bool:
        if not line.startswith(RELAY_PREFIX):
            return False
        msg = json.loads(line[len(RELAY_PREFIX):])
        name = msg["call"]
        if name.startswith("_") or name == "finish" or not callable(getattr(RunLogger, name, None)):
            raise ValueError(f"rank 0 relayed {name!r}, which is no RunLogger logging method")
        if name == "log_metrics_once":
            self.once.log_metrics(*msg["args"], **msg["kwargs"])
        else:
            getattr(self.logger, name)(*msg["args"], **msg["kwargs"])
        return True

    def close(self) -> None:
        if self.system_metrics is not None:
            self.system_metrics.finish()
            self.system_metrics = None


def logger_for(is_main: bool) -> RunLogger | RelayLogger | NullLogger:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not (is_main and run_id):
        return NullLogger()
    return RelayLogger() if os.environ.get(RELAY_ENV) == "stdout" else RunLogger(run_id)
