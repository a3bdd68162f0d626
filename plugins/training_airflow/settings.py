"""Where things live on the worker. Every path can be moved with an environment variable."""

from __future__ import annotations

import os
from pathlib import Path

# plugins/training_airflow/settings.py -> project root
PROJECT_ROOT = Path(os.environ.get("TRAINING_HOME") or Path(__file__).resolve().parents[2])
VAR = Path(os.environ.get("TRAINING_VAR_DIR") or PROJECT_ROOT / "var")


def work_dir() -> Path:
    """Local per-run folders (config, checkpoints, output) on the worker."""
    return Path(os.environ.get("TRAINING_WORK_DIR") or VAR / "work")


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
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return uri


def resolve_path(value: str) -> str:
    """A relative dataset path in a Param is relative to the project, not to the worker's cwd."""
    if "://" in value or Path(value).is_absolute():
        return value.removeprefix("file://") if value.startswith("file://") else value
    return str(PROJECT_ROOT / value)
