"""Airflow as people use it, against the real servers on 127.0.0.1 (fixture ``live_airflow``):
trigger over REST, bad input refused, new data starting a run, a cleared task re-running into the
same MLflow run, and comparing the runs afterwards through MlflowClient and `training compare`.

The runs start together in one session fixture (``live_runs`` in tests/e2e/conftest.py, shared
with the web-UI tests; different DAGs run side by side) to keep the wall time down; each test then
waits for the part it checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from airflow_client.client.exceptions import BadRequestException
from mlflow.tracking import MlflowClient

from tests.e2e.conftest import EXPERIMENT, ON_DATA, REGISTER, STEPS, TRAIN
from training.tracking.run import summary_of

pytestmark = pytest.mark.slow

CORE = ("open_run", "validate_data", "tokenize", "train", "upload_checkpoint", "evaluate", "register", "report")


def _mlflow_runs(dag_id: str, dag_run_id: str):
    client = MlflowClient()
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`airflow.dag_id` = '{dag_id}' and tags.`airflow.dag_run_id` = '{dag_run_id}'")


@pytest.fixture(scope="module")
def started(live_runs):
    return live_runs  # started once per session (tests/e2e/conftest.py), shared with the web-UI tests


def test_invalid_conf_is_refused_with_400_and_no_run(live_airflow):
    af = live_airflow
    af.wait_for_dags(TRAIN)
    before = len(af.runs(TRAIN))
    for conf, field, words in (({"world_size": 0}, "world_size", "less than the minimum of 1"),
                               ({"strategy": "zero3"}, "strategy", "is not one of"),
                               ({"model": "resnet9000"}, "model", "does not match"),
                               ({"lr": "fast"}, "lr", "is not of type 'number'"),
                               ({"experiment": "../etc"}, "experiment", "does not match")):
        with pytest.raises(BadRequestException) as refused:
            af.trigger(TRAIN, conf)
        detail = json.loads(refused.value.body)["detail"]
        assert f"param {field}" in detail and words in detail, detail
    assert len(af.runs(TRAIN)) == before, "a refused trigger creates no DAG run"


@pytest.mark.budget(420, reason="the first to wait for the session's DAG runs, which start together in live_runs "
                                 "and share two cores")
def test_rest_trigger_runs_and_xcom_names_the_mlflow_run(live_airflow, started):
    af, run_id = live_airflow, started["rest"]
    run = af.wait_for_run(TRAIN, run_id, timeout=900)
    states = af.task_states(TRAIN, run_id)
    assert run["state"] == "success", states
    # A local-only deployment (the default TRAINING_BACKENDS): no task of another backend at all.
    assert states == {t: "success" for t in CORE}, states

    handoff = af.xcom(TRAIN, run_id, "validate_data")
    mlflow_run_id = handoff["mlflow_run_id"]
    (mlrun,) = _mlflow_runs(TRAIN, run_id)
    assert mlrun.info.run_id == mlflow_run_id and mlrun.info.status == "FINISHED"
    tags, params = mlrun.data.tags, mlrun.data.params
    assert tags["backend"] == "local" and tags["world_size"] == "1" and tags["data.fingerprint"] == handoff["dataset_fingerprint"]
    assert {"strategy", "precision", "model"} <= set(tags)
    assert (params["steps"], params["world_size"]) == (str(STEPS), "1")
    registry = af.xcom(TRAIN, run_id, "register")["registry"]
    assert registry["registered_model"] == EXPERIMENT and tags["registry.version"] == registry["version"]
    assert tags["registry.decision"] == registry["decision"] and tags["registry.reason"]


def test_cross_field_rule_fails_the_first_task(live_airflow, started):
    af, run_id = live_airflow, started["bad"]
    run = af.wait_for_run(ON_DATA, run_id, timeout=600)
    states = af.task_states(ON_DATA, run_id)
    assert run["state"] == "failed" and states["open_run"] == "failed", states
    assert all(states[t] == "upstream_failed" for t in CORE[1:]), states
    log = af.task_log(ON_DATA, run_id, "open_run")
    assert "AirflowFailException: invalid run parameters: config field 'batch_size': 33 is not divisible by" in log
    assert "world_size=2" in log, log[-2000:]
    assert _mlflow_runs(ON_DATA, run_id) == [], "refused before an MLflow run was opened"


def test_new_data_starts_a_training_run_on_that_data(live_airflow, started):
    af = live_airflow
    reg = af.wait_for_run(REGISTER, started["register"], timeout=600)
    assert reg["state"] == "success", af.task_states(REGISTER, started["register"])
    event = af.xcom(REGISTER, started["register"], "register")
    assert event["dataset_uri"] == str(started["landed"]) and len(event["fingerprint"]) == 64

    deadline = time.monotonic() + 300
    while not (runs := af.runs(ON_DATA, run_type="asset_triggered")) and time.monotonic() < deadline:
        time.sleep(2)
    assert len(runs) == 1, "one asset event, one training run"
    run_id = runs[0]["dag_run_id"]
    run = af.wait_for_run(ON_DATA, run_id, timeout=1200)
    assert run["state"] == "success", af.task_states(ON_DATA, run_id)
    (mlrun,) = _mlflow_runs(ON_DATA, run_id)
    assert mlrun.data.tags["dataset_uri"] == event["dataset_uri"], "trained on the data that landed"
    assert mlrun.data.tags["data.fingerprint"] == event["fingerprint"]
    started["asset_run"] = run_id


@pytest.mark.budget(300, reason="evaluate, register and report run again on the live stack")
def test_cleared_task_reruns_into_the_same_mlflow_run(live_airflow, started):
    af, run_id = live_airflow, started["rest"]
    assert af.wait_for_run(TRAIN, run_id, timeout=900)["state"] == "success"
    (before,) = _mlflow_runs(TRAIN, run_id)
    af.clear(TRAIN, run_id, ["evaluate"])  # evaluate, register and report run again, as after a failure
    run = af.wait_for_run(TRAIN, run_id, timeout=900)
    assert run["state"] == "success", af.task_states(TRAIN, run_id)
    tries = af.try_numbers(TRAIN, run_id)
    assert (tries["evaluate"], tries["register"], tries["report"], tries["train"]) == (2, 2, 2, 1), tries
    (after,) = _mlflow_runs(TRAIN, run_id)  # still exactly one MLflow run
    assert after.info.run_id == before.info.run_id and after.info.status == "FINISHED"
    client = MlflowClient()
    for name in ("eval/accuracy", "eval/loss", "train/loss"):
        steps = [m.step for m in client.get_metric_history(after.info.run_id, name)]
        assert steps and len(steps) == len(set(steps)), (name, steps)
    assert summary_of(after)["dag_wall_s"] > 0  # a one-off figure: the run summary, overwritten by a re-run
    versions = client.search_model_versions(f"name = '{EXPERIMENT}' and run_id = '{after.info.run_id}'")
    assert len(versions) == 1, "the re-run evaluate registered nothing new"
    assert af.xcom(TRAIN, run_id, "register")["registry"]["version"] == str(versions[0].version)

    # Each task alone, cleared after the run finished: still one value per step for every metric.
    for task in CORE:
        af.clear(TRAIN, run_id, [task], downstream=False)
        run = af.wait_for_run(TRAIN, run_id, timeout=900)
        assert run["state"] == "success", (task, af.task_states(TRAIN, run_id))
        (again,) = _mlflow_runs(TRAIN, run_id)
        assert again.info.run_id == before.info.run_id and again.info.status == "FINISHED", task
        for key in again.data.metrics:
            steps = [m.step for m in client.get_metric_history(again.info.run_id, key)]
            assert len(steps) == len(set(steps)), (task, key, sorted(steps))
    assert len(client.search_model_versions(f"name = '{EXPERIMENT}' and run_id = '{before.info.run_id}'")) == 1


def test_compare_the_runs_and_find_the_champion(live_airflow, started, tmp_path):
    """What a person does after the runs: look them up in MLflow and compare them."""
    assert "asset_run" in started, "needs the data-driven run"
    client = MlflowClient()
    exp = client.get_experiment_by_name(EXPERIMENT)
    one_rank = client.search_runs([exp.experiment_id], filter_string="params.world_size = '1'")
    two_ranks = client.search_runs([exp.experiment_id], filter_string="params.world_size = '2'")
    assert [r.data.tags["airflow.dag_run_id"] for r in one_rank] == [started["rest"]]
    assert [r.data.tags["airflow.dag_run_id"] for r in two_ranks] == [started["asset_run"]]
    for run in one_rank + two_ranks:
        loss = client.get_metric_history(run.info.run_id, "train/loss")
        assert loss and loss[-1].value < loss[0].value, "a loss curve that went down"
        assert set(run.data.tags) >= {"airflow.dag_id", "airflow.dag_run_id", "backend", "world_size", "strategy",
                                      "precision", "data.fingerprint", "registry.decision"}
    assert set(one_rank[0].data.params) == set(two_ranks[0].data.params), "same params on every run"
    # The same names for the same figures on every run (2 ranks add per-rank and bandwidth figures).
    common = {"train/loss", "train/lr", "perf/samples_per_s", "perf/step_s", "comm/s_per_step", "eval/loss",
              "eval/accuracy", "ckpt/save_s"}
    assert common <= set(one_rank[0].data.metrics) and common <= set(two_ranks[0].data.metrics)
    figures = {"dag_wall_s", "torchrun_wall_s", "goodput"}  # one-off: the run summary
    assert figures <= set(summary_of(one_rank[0])) and figures <= set(summary_of(two_ranks[0]))

    champion = client.get_model_version_by_alias(EXPERIMENT, "champion")
    source = client.get_run(champion.run_id)
    assert source.data.tags["registry.decision"] == "champion"
    assert source.data.tags["registry.version"] == str(champion.version)
    assert "eval/accuracy" in source.data.metrics
    versions = client.search_model_versions(f"name = '{EXPERIMENT}'")
    assert sorted(v.run_id for v in versions) == sorted(r.info.run_id for r in one_rank + two_ranks)
    other = next(r for r in one_rank + two_ranks if r.info.run_id != champion.run_id)
    if other.data.tags["registry.decision"] == "challenger":
        assert client.get_model_version_by_alias(EXPERIMENT, "challenger").run_id == other.info.run_id
        assert "does not beat" in other.data.tags["registry.reason"]
    else:  # it was champion first and was replaced by the later, better model
        assert int(other.data.tags["registry.version"]) < int(champion.version)

    out = tmp_path / "compare"
    result = subprocess.run([sys.executable, "-m", "training", "compare", "--experiment", EXPERIMENT, "--last", "5",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["runs"]) == sorted(r.info.run_id for r in one_rank + two_ranks)
    md = (out / "report.md").read_text()
    for run in one_rank + two_ranks:
        assert f"| {run.info.run_id} |" in md
    for png in ("scaling.png", "step_time.png", "loss.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
