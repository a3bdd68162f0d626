"""What the tests that use Airflow and MLflow as people do share, once per session:

- ``live_airflow``: api-server, scheduler, dag-processor, triggerer on 127.0.0.1;
- ``live_runs``: the DAG runs those tests look at, started together at the first use (different
  DAGs run side by side, which keeps the wall time down); each test waits for the one it checks;
- ``mlflow_ui``: MLflow's own server on 127.0.0.1 over the session's tracking store, the UI the
  Airflow link points to (its address is known before Airflow starts);
- ``container_engine``, ``training_image``, ``mlflow_server``: podman (or docker), the CPU training
  image built once, and an MLflow server the pods reach (tests/e2e/pods.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from tests.e2e.browser import Browser, chromium_path
from tests.e2e.live_airflow import LiveAirflow
from training.util import free_port, stop_process

TRAIN, ON_DATA, REGISTER = "distributed_training", "distributed_training_on_data", "register_dataset"
EXPERIMENT = "distributed_training"  # the data-driven run records here too: one experiment to compare
STEPS = 20
RUN_NOTE = "Baseline on one rank, for the scaling comparison"


@pytest.fixture(scope="session")
def mlflow_ui_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def live_airflow(tmp_root, mlflow_ui_url):
    # TRAINING_SCHEDULE=none: with the default nightly cron, unpausing distributed_training would
    # start the latest scheduled run at once (catchup=False still runs the most recent one) with the
    # default Params, ahead of the run under test (max_active_runs=1). The schedule itself is
    # checked where the DAG is parsed (tests/dags/test_forms.py).
    # TRAINING_MAX_ACTIVE_RUNS / PARALLELISM: room for the five concurrent runs of test_live_load.py.
    airflow = LiveAirflow(tmp_root / "airflow-live",
                          extra_env={"TRAINING_SCHEDULE": "none", "TRAINING_MLFLOW_UI_URL": mlflow_ui_url,
                                     "TRAINING_MAX_ACTIVE_RUNS": "5", "AIRFLOW__CORE__PARALLELISM": "8"})
    try:
        yield airflow.start()
    finally:
        airflow.stop()


@pytest.fixture(scope="session")
def mlflow_ui(mlflow_ui_url, tmp_root):
    """``mlflow server`` as ``make mlflow-ui`` runs it, over the tests' tracking store."""
    from training_airflow import settings

    # As `make mlflow-ui` does: the store's tables first, under the lock the tasks take. A server
    # that creates them itself races with tasks doing the same (`table datasets already exists`).
    settings.ensure_tracking_uri()
    port = mlflow_ui_url.rsplit(":", 1)[1]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp_root / "mlflow-ui.log", "ab")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                             port, "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"],
                             "--default-artifact-root", str(tmp_root / "mlflow-ui-artifacts")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_root / "mlflow-ui.log").read_text()[-3000:]
            try:
                if requests.get(f"{mlflow_ui_url}/health", timeout=5).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):
                pass
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            time.sleep(1)
        yield mlflow_ui_url
    finally:
        stop_process(proc)


def _bad_copy(dataset: Path, to: Path) -> Path:
    """The dataset with 50 missing values in a feature: the data gate refuses it."""
    if not to.exists():
        shutil.copytree(dataset, to)
        path = to / "train" / "part-00000.parquet"
        df = pq.read_table(path).to_pandas()
        df.loc[:49, "f5"] = np.nan
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    return to


@pytest.fixture(scope="session")
def live_runs(live_airflow, dataset, tmp_root):
    """REST-triggered run (1 rank), a run refused by a cross-field rule before its MLflow run opens,
    new data announced by register_dataset (which starts the data-driven run, 2 ranks), and a run
    whose data fails the gate after its MLflow run opened (distributed_training_on_data, manual)."""
    af = live_airflow
    af.wait_for_dags(TRAIN, ON_DATA, REGISTER)
    for dag_id in (TRAIN, ON_DATA, REGISTER):
        af.unpause(dag_id)
    conf = {"dataset_uri": str(dataset), "experiment": EXPERIMENT, "world_size": 1, "steps": STEPS,
            "batch_size": 64, "checkpoint_every": 10, "store_uri": (tmp_root / "live-store").as_uri()}
    # With a note, as a person writes one when triggering: the MLflow run's description carries it.
    rest = af.trigger(TRAIN, conf, note=RUN_NOTE)
    # Valid for the form, but 33 does not split over 2 ranks: only the first task can tell.
    bad = af.trigger(ON_DATA, {**conf, "world_size": 2, "batch_size": 33})
    landed = tmp_root / "data" / "landed"
    register = af.trigger(REGISTER, {"dataset_uri": str(landed), "train_rows": 4_000, "val_rows": 1_000, "seed": 7})
    bad_data = af.trigger(ON_DATA, {**conf, "dataset_uri": str(_bad_copy(dataset, tmp_root / "data" / "bad-nan"))})
    return {"rest": rest, "bad": bad, "register": register, "landed": landed, "bad_data": bad_data}


@pytest.fixture
def browser():
    """Headless chromium (tests/e2e/browser.py), a fresh profile per test."""
    assert chromium_path(), "chromium is missing: `make test` installs it (apt-get install -y chromium)"
    b = Browser(width=1600, height=1000).start()
    try:
        yield b
    finally:
        b.close()


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
        stop_process(proc)
