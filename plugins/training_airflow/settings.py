"""Where things live on the worker. Every path can be moved with an environment variable."""

from __future__ import annotations

import os
from pathlib import Path

# plugins/training_airflow/settings.py -> project root
PROJECT_ROOT = Path(os.environ.get("TRAINING_HOME") or Path(__file__).resolve().parents[2])
VAR = Path(os.environ.get("TRAINING_VAR_DIR") or PROJECT_ROOT / "var")


def work_dir(run_id: str | None = None) -> Path:
    """Local per-run folders (config, checkpoints, output) on the worker; ``run_id``: the folder of
    one MLflow run, stable across task retries."""
    root = Path(os.environ.get("TRAINING_WORK_DIR") or VAR / "work")
    return root / run_id if run_id else root


def sweep_storage_url() -> str:
    """Where sweeps keep their Optuna studies: ``TRAINING_SWEEP_STORAGE`` (an SQLAlchemy URL, e.g.
    Postgres in the compose stack), else a SQLite file in the work folder. It may hold a password:
    it reaches the ranks as environment, never as arguments or in logs."""
    return os.environ.get("TRAINING_SWEEP_STORAGE") or f"sqlite:///{work_dir() / 'sweeps.db'}"


def default_dataset_uri() -> str:
    return str(VAR / "data" / "teacher")


def default_store_uri() -> str:
    return (VAR / "store").as_uri()


def default_tracking_uri() -> str:
    return f"sqlite:///{VAR / 'mlflow' / 'mlflow.db'}"


def ensure_tracking_uri() -> str:
    """MLflow's own variable wins; otherwise the project-local SQLite store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = default_tracking_uri()
        os.environ["MLFLOW_TRACKING_URI"] = uri
    if uri.startswith("sqlite:///"):
        _init_sqlite_store(uri)
    return uri


_STORES_READY: set[str] = set()


def _init_sqlite_store(uri: str) -> None:
    """Create a new SQLite MLflow store's tables once, under a file lock. Every MLflow client that
    opens a store creates the tables and the Default experiment when they are missing; tasks of
    several DAG runs starting at once on a fresh store would race on that and one would fail with
    ``UNIQUE constraint failed: experiments.workspace, name``."""
    if uri in _STORES_READY:
        return
    from filelock import FileLock

    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(db.with_name(db.name + ".init-lock")):
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    _STORES_READY.add(uri)


def mlflow_ui_url() -> str:
    """Where people open MLflow (links, printed URLs): ``TRAINING_MLFLOW_UI_URL``; else the tracking
    server itself when the tracking URI is one; else ``make mlflow-ui``'s address."""
    ui = os.environ.get("TRAINING_MLFLOW_UI_URL") or ""
    if not ui:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        ui = uri if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return ui.rstrip("/")


def airflow_ui_url() -> str:
    """Where people open Airflow: its ``[api] base_url`` (``AIRFLOW__API__BASE_URL``)."""
    from airflow.configuration import conf  # loaded already in every Airflow process

    return (conf.get("api", "base_url", fallback="") or "http://127.0.0.1:8080").rstrip("/")


def resolve_path(value: str) -> str:
    """A relative dataset path in a Param is relative to the project, not to the worker's cwd."""
    if "://" in value or Path(value).is_absolute():
        return value.removeprefix("file://") if value.startswith("file://") else value
    return str(PROJECT_ROOT / value)


# Nightly at 03:00 UTC unless the deployment says otherwise.
DEFAULT_SCHEDULE = "0 3 * * *"


def training_schedule() -> str | None:
    """Schedule of ``distributed_training``: ``TRAINING_SCHEDULE`` (a cron expression or a preset
    such as ``@daily``; ``none`` for manual and data-driven runs only). Read when the DAG file is
    parsed, so set it in the environment of the dag-processor and scheduler."""
    value = os.environ.get("TRAINING_SCHEDULE", DEFAULT_SCHEDULE).strip()
    if value.lower() in ("", "none", "null", "off"):
        return None
    from croniter import croniter  # Airflow's own cron parser; light, unlike the training stack

    presets = {"@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@once", "@continuous"}
    if value not in presets and not croniter.is_valid(value):
        raise ValueError(f"TRAINING_SCHEDULE={value!r} is not a cron expression. Fix: use e.g. '0 3 * * *', "
                         "'@daily', or 'none' for no schedule")
    return value


def local_metrics_host(requested: str, default: str) -> str:
    """Where the local backend's ranks serve their metrics: the run's ``metrics_host`` when it asks
    for an address, else ``TRAINING_METRICS_HOST`` when the deployment sets one (a worker container
    whose ranks a Prometheus in another container scrapes: its own name or address), else the
    field's default (127.0.0.1)."""
    deployment = os.environ.get("TRAINING_METRICS_HOST", "").strip()
    return deployment if deployment and requested == default else requested


BACKENDS = ("local", "kubernetes")


def enabled_backends() -> list[str]:
    """Where this deployment can train: ``TRAINING_BACKENDS``, a comma-separated subset of
    ``local`` (torchrun on the Airflow worker) and ``kubernetes`` (pods on a cluster); default
    ``local``. Read when the DAG files are parsed: the DAG holds the task group of each enabled
    backend and nothing of the others, and the form offers only them (with several, a branch
    follows the Param ``backend``)."""
    raw = os.environ.get("TRAINING_BACKENDS", "local")
    names = [b.strip() for b in raw.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"TRAINING_BACKENDS={raw!r} names {unknown or 'no backend'}. Fix: a comma-separated list "
                         f"of {', '.join(BACKENDS)}, e.g. 'local' or 'local,kubernetes'")
    return list(dict.fromkeys(names))


def max_active_runs() -> int:
    """``TRAINING_MAX_ACTIVE_RUNS`` (default 1): how many runs of each training DAG may run at once
    on this deployment. Runs never share ports, work folders or MLflow runs, so more is safe where
    the workers have the cores (and the metadata DB is not SQLite under heavy load)."""
    raw = os.environ.get("TRAINING_MAX_ACTIVE_RUNS", "1").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TRAINING_MAX_ACTIVE_RUNS={raw!r} is not a positive integer. Fix: e.g. 1 or 4")
    return int(raw)
