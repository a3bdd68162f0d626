"""The live Airflow (api-server, scheduler, dag-processor, triggerer on 127.0.0.1) shared by the
tests that use Airflow as a person does: REST, the web UI, the scheduler reacting to data."""

from __future__ import annotations

import pytest

from tests.e2e.live_airflow import LiveAirflow


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
    """A real MLflow tracking server on 127.0.0.1, reachable from pods as mlflow.pods.test."""
    from tests.e2e.pods import start_mlflow_server

    addresses, proc = start_mlflow_server(tmp_root / "mlflow-server")
    try:
        yield addresses
    finally:
        proc.terminate()
        proc.wait(timeout=30)
