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
    # TRAINING_MAX_ACTIVE_RUNS / PARALLELISM: room for the five concurrent runs of test_live_load.py.
    airflow = LiveAirflow(tmp_root / "airflow-live", extra_env={"TRAINING_SCHEDULE": "none", "TRAINING_MAX_ACTIVE_RUNS": "5",
                                                                "AIRFLOW__CORE__PARALLELISM": "8"})
    try:
        yield airflow.start()
    finally:
        airflow.stop()
