"""The live Airflow (api-server, scheduler, dag-processor, triggerer on 127.0.0.1) shared by the
tests that use Airflow as a person does: REST, the web UI, the scheduler reacting to data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for_port
from tests.e2e.live_airflow import LiveAirflow
from training.util import free_port


@pytest.fixture(scope="session")
def live_airflow(tmp_root):
    # TRAINING_SCHEDULE=none: with the default nightly cron, unpausing distributed_training would
    # start the latest scheduled run at once (catchup=False still runs the most recent one) with the
    # default Params, ahead of the run under test (max_active_runs=1). The schedule itself is
    # checked where the DAG is parsed (tests/dags/test_forms.py).
    airflow = LiveAirflow(tmp_root / "airflow-live", extra_env={"TRAINING_SCHEDULE": "none"})
    try:
        yield airflow.start()
    finally:
        airflow.stop()


# --------------------------------------------------------------------------- containers


@pytest.fixture(scope="session")
def container_engine():
    """podman (with this project's settings) or docker; `make test` installs podman (`make podman`)."""
    from scripts import images

    engine = images.engine()
    if engine is None:
        pytest.fail(images.INSTALL_HINT)
    return engine


@pytest.fixture(scope="session")
def training_image(container_engine) -> str:
    """The CPU training image on the Debian base, built once per session (`make images`' recipe;
    unchanged layers come from the engine's cache)."""
    from scripts import images

    return images.training_image(container_engine, base="debian")


@pytest.fixture(scope="session")
def mlflow_server(tmp_root):
    """A real MLflow tracking server on 127.0.0.1 (SQLite store, artifacts served by the server),
    reachable from pods under the name ``mlflow.pods.test`` (their hosts file maps it to 127.0.0.1)."""
    port = free_port()
    root = tmp_root / "mlflow-server"
    root.mkdir()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--allowed-hosts", f"127.0.0.1:{port},mlflow.pods.test:{port}"],
        stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        wait_for_port(port, timeout=120)
        yield {"worker_uri": f"http://127.0.0.1:{port}", "pod_uri": f"http://mlflow.pods.test:{port}", "log": root / "server.log"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
