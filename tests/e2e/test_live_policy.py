"""The deployment policy against a live Airflow with both backends and a team's policy file
(TRAINING_POLICY): each rule refuses a trigger over the REST API with 400 naming the rule, the
value and what is allowed, and no run is made; a run made past the api-server (``airflow dags
trigger``) with a factory outside the allowed packages fails in its first task before the module
is imported (its import would write a file); the same conf within the policy is accepted, and the
MLflow run records the runtime, the policy's sha256 and who triggered it.

Its own Airflow (the session's is local-only, with the permissive default policy, as a laptop)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from airflow_client.client.exceptions import BadRequestException
from mlflow.tracking import MlflowClient

from tests.e2e.conftest import ON_DATA, TRAIN
from tests.e2e.live_airflow import LiveAirflow

pytestmark = pytest.mark.slow

EXPERIMENT = "policy_e2e"


@pytest.fixture(scope="module")
def team(tmp_root):
    """The team's policy file, a factory module outside its packages whose import writes a file,
    and a live Airflow that runs under them."""
    root = tmp_root / "policy-e2e"
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    marker = root / "outside_models-was-imported"
    (code / "outside_models.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
                                            "def build(spec):\n    raise RuntimeError('never called')\n")
    store = (root / "store").as_uri()
    policy_file = root / "policy.yaml"
    policy_file.write_text(f"""
runtimes:
  cpu:
    description: one worker, a few ranks
    backend: local
    ceilings: {{ranks: 2}}
  gpu-8:
    description: eight GPUs per pod
    backend: kubernetes
    images: ["registry.example.com/ml/"]
    namespaces: [team-a]
    s3_secret: team-a-s3
    ceilings: {{nodes: 4, gpus_per_node: 8}}
ceilings: {{steps: 1000}}
code: {{model_prefixes: [team_models]}}
data:
  dataset_uri: [{tmp_root / "data"}]
  store_uri: [{store}, "s3://team-a-ckpt"]
""")
    airflow = LiveAirflow(root / "airflow", extra_env={
        "TRAINING_POLICY": str(policy_file), "TRAINING_BACKENDS": "local,kubernetes", "TRAINING_SCHEDULE": "none",
        "TRAINING_MAX_ACTIVE_RUNS": "2", "PYTHONPATH": str(code)})
    try:
        airflow.start(triggerer=False)  # nothing here defers
        airflow.wait_for_dags(TRAIN, ON_DATA)
        yield {"af": airflow, "marker": marker, "store": store, "policy": policy_file}
    finally:
        airflow.stop()


def _refused(af, dag_id: str, conf: dict) -> str:
    with pytest.raises(BadRequestException) as refused:
        af.trigger(dag_id, conf)
    return json.loads(refused.value.body)["detail"]


def test_each_rule_is_refused_over_rest_and_a_conf_within_runs(team, dataset):
    af = team["af"]
    gpu = {"runtime": "gpu-8", "backend": "kubernetes", "k8s_image": "registry.example.com/ml/train:1",
           "k8s_namespace": "team-a", "k8s_nnodes": 2, "k8s_gpus_per_node": 8, "dataset_uri": str(dataset),
           "store_uri": "s3://team-a-ckpt/runs", "steps": 20, "experiment": EXPERIMENT}
    cases = [
        ({"k8s_image": "docker.io/evil/miner:latest"}, "k8s_image", "runtimes.gpu-8.images",
         "Fix: use an image matching one of 'registry.example.com/ml/'"),
        ({"k8s_namespace": "kube-system"}, "k8s_namespace", "runtimes.gpu-8.namespaces", "Fix: use one of 'team-a'"),
        ({"k8s_nnodes": 5}, "k8s_nnodes", "ceilings of runtime gpu-8: nodes", "Fix: use at most 4 (nodes)"),
        ({"model": "outside_models:build"}, "model", "code.model_prefixes",
         "Fix: use a built-in family or a factory from a package under one of 'team_models'"),
        ({"store_uri": "s3://other-team/ckpt"}, "store_uri", "data.store_uri",
         f"Fix: use a URI under one of '{team['store']}', 's3://team-a-ckpt'"),
        ({"runtime": "gpu-80"}, "runtime", "runtimes", "Fix: use one of 'cpu', 'gpu-8'"),
    ]
    before = len(af.runs(TRAIN))
    for change, field, rule, allowed in cases:
        detail = _refused(af, TRAIN, {**gpu, **change})
        value = next(iter(change.values()))
        assert detail.startswith(f"config field '{field}': {value!r} is refused by the deployment policy "
                                 f"(rule {rule}). {allowed}"), detail
    assert len(af.runs(TRAIN)) == before, "a refused trigger makes no DAG run"
    # The same conf within the policy is accepted (on the paused data-driven DAG: it never runs here).
    assert af.trigger(ON_DATA, gpu)

    # A local run within the policy passes the check and records who asked and under what.
    af.unpause(TRAIN)
    local = {"runtime": "cpu", "backend": "local", "world_size": 1, "steps": 20, "dataset_uri": str(dataset),
             "store_uri": team["store"], "experiment": EXPERIMENT}
    assert "config field 'world_size': 3" in _refused(af, TRAIN, {**local, "world_size": 3})
    within = af.trigger(TRAIN, local)

    # A run made past the api-server: its first task refuses the factory before importing it.
    cli = subprocess.run([str(Path(sys.executable).parent / "airflow"), "dags", "trigger", TRAIN, "--run-id",
                          "policy-cli", "-c", json.dumps({**local, "model": "outside_models:build"})],
                         env=af.env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    refused = af.wait_for_run(TRAIN, "policy-cli", timeout=600)
    states = af.task_states(TRAIN, "policy-cli")
    assert refused["state"] == "failed" and states["open_run"] == "failed", states
    assert "config field 'model': 'outside_models:build' is refused by the deployment policy (rule " \
           "code.model_prefixes)" in af.task_log(TRAIN, "policy-cli", "open_run")
    assert not team["marker"].exists(), "the factory's module was imported before the policy refused it"

    af._wait(lambda: af.task_states(TRAIN, within).get("open_run") in ("success", "failed"), 600, 2,
             lambda why: f"open_run of {within} did not end: {why}")
    assert af.task_states(TRAIN, within)["open_run"] == "success", af.task_log(TRAIN, within, "open_run")[-3000:]
    # Checked: no need to train it (the rest of the pipeline is tested elsewhere).
    requests.patch(f"{af.base}/api/v2/dags/{TRAIN}/dagRuns/{within}", json={"state": "failed"},
                   headers={"Authorization": f"Bearer {af.token()}"}, timeout=60).raise_for_status()
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                                filter_string=f"tags.`airflow.dag_run_id` = '{within}'")
    tags = run.data.tags
    assert tags["policy.runtime"] == "cpu" and tags["airflow.triggered_by"] == "admin"
    assert tags["policy.sha256"] == hashlib.sha256(team["policy"].read_bytes()).hexdigest()
    assert "**Triggered by:** admin · **runtime** `cpu`" in tags["mlflow.note.content"]
    assert not team["marker"].exists()
