"""The deployment policy (training_airflow/policy.py): the loader names the file and the key of a
mistake; each rule refuses a run's Params naming the rule, the value and what is allowed; the form
offers the runtimes and the ceilings; the built-in default allows what the form allows. Against a
live Airflow: tests/e2e/test_live_policy.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from training_airflow import policy
from training_airflow.params import training_params

TEAM = """
runtimes:
  cpu:
    description: CPU smoke tests on the worker
    backend: local
    ceilings: {ranks: 4}
  gpu-8:
    backend: kubernetes
    images: ["registry.example.com/ml/", "sha256:%s"]
    namespaces: [team-a]
    service_account: team-a-trainer
    image_pull_secret: team-a-pull
    node_selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
    tolerations: [{key: team-a, operator: Exists, effect: NoSchedule}]
    s3_secret: team-a-s3
    pvcs: [team-a-data, team-a-ckpt]
    mlflow_secret: team-a-mlflow
    ceilings: {nodes: 4, gpus_per_node: 8, gpus: 32, memory_per_pod: 512Gi, cpu_per_pod: "96"}
ceilings: {steps: 100000, wall_clock_s: 86400}
code: {model_prefixes: [team_models], hf_roots: ["s3://team-a-models"]}
data: {dataset_uri: ["/data", "s3://team-a-data"], store_uri: ["s3://team-a-ckpt"], tokenizer: ["s3://team-a-models"],
       connections: [team_a_s3]}
""" % ("a" * 64)


@pytest.fixture
def team(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(TEAM)
    return policy.load(str(path))


GPU = {"runtime": "gpu-8", "backend": "kubernetes", "k8s_image": "registry.example.com/ml/train:1",
       "k8s_namespace": "team-a", "k8s_nnodes": 2, "k8s_gpus_per_node": 8, "k8s_memory_limit": "256Gi",
       "k8s_cpu_limit": "64", "k8s_active_deadline_s": 3600, "steps": 1000, "model": "transformer",
       "dataset_uri": "s3://team-a-data/lm", "store_uri": "s3://team-a-ckpt/runs", "k8s_data_pvc": "team-a-data",
       "k8s_checkpoint_pvc": "team-a-ckpt", "tokenizer": "s3://team-a-models/bpe/tokenizer.json",
       "aws_conn_id": "team_a_s3"}
CPU = {"runtime": "cpu", "backend": "local", "world_size": 2, "steps": 100, "model": "team_models.mlp:build",
       "dataset_uri": "/data/teacher", "store_uri": "s3://team-a-ckpt"}


@pytest.mark.parametrize("text, message", [
    ("runtimes: {cpu: {imagez: []}}", "key runtimes.cpu.imagez: is not a key of the policy"),
    ("ceilings: {nodes: 0}", "key ceilings.nodes: Input should be greater than or equal to 1"),
    ("ceilings: {memory_per_pod: lots}", "key ceilings.memory_per_pod: 'lots' is not a Kubernetes quantity"),
    ("runtimes: {gpu: {images: ['registry.example.com/ml']}}", "key runtimes.gpu.images: 'registry.example.com/ml' "
     "is neither a registry prefix ending in '/'"),
    ("runtimes: {gpu: {namespaces: [Team_A]}}", "key runtimes.gpu.namespaces: 'Team_A' is not a Kubernetes namespace"),
    ("runtimes: {}", "key runtimes: Dictionary should have at least 1 item"),
    ("runtimes: {GPU: {}}", "key runtimes: runtime name 'GPU' is not lower-case"),
    ("code: {model_prefixes: ['team models']}", "key code.model_prefixes: 'team models' is not a dotted module name"),
    ("data: {store_uri: [relative/folder]}", "key data.store_uri: 'relative/folder' is neither an absolute folder"),
    ("runtimes: {gpu: {tolerations: [{operator: Maybe}]}}", "key runtimes.gpu.tolerations.0.operator: Input should be"),
    ("runtimes: [cpu]", "key runtimes: Input should be a valid dictionary"),
    ("- a list", "the top level must be a mapping"),
    ("runtimes: {cpu: {backend: local}\n", "line 2: not valid YAML"),
])
def test_a_broken_policy_file_is_refused_naming_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(policy.PolicyFileError) as refused:
        policy.load(str(path))
    assert str(refused.value).startswith(f"policy file {path}"), str(refused.value)
    assert message in str(refused.value), str(refused.value)


def test_a_missing_file_is_named_with_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(policy.ENV, str(tmp_path / "nope.yaml"))
    with pytest.raises(policy.PolicyFileError, match=r"nope.yaml \(TRAINING_POLICY\): cannot be read"):
        policy.load()


def test_no_file_is_the_permissive_default_and_an_edit_is_a_new_version(tmp_path, monkeypatch):
    monkeypatch.delenv(policy.ENV, raising=False)
    assert policy.load() is policy.PERMISSIVE
    assert policy.check({**GPU, "runtime": "default", "k8s_image": "anything:latest", "k8s_nnodes": 256}) == "default"
    path = tmp_path / "p.yaml"
    path.write_text(TEAM)
    first = policy.load(str(path))
    path.write_text(TEAM.replace("ranks: 4", "ranks: 3"))
    second = policy.load(str(path))
    assert first.sha256 != second.sha256 and second.policy.runtimes["cpu"].ceilings.ranks == 3
    import hashlib

    assert second.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and second.source == str(path)


def test_conf_within_the_policy_passes(team):
    assert policy.check(GPU, team) == "gpu-8"
    assert policy.check(CPU, team) == "cpu"
    assert policy.check({**GPU, "k8s_image": "other.example.com/x/y@sha256:" + "a" * 64}, team) == "gpu-8"
    assert policy.check({**CPU, "model": "mlp"}, team) == "cpu"  # built-in families always
    for made_from_the_data in ("bpe:4096", "bytes", None):  # no tokenizer file is read
        assert policy.check({**GPU, "tokenizer": made_from_the_data}, team) == "gpu-8"
    assert policy.check({**GPU, "aws_conn_id": None}, team) == "gpu-8"  # the worker's own keys


@pytest.mark.parametrize("change, field, rule, allowed", [
    ({"runtime": "gpu-80"}, "runtime", "runtimes", "one of 'cpu', 'gpu-8'"),
    ({"backend": "local"}, "backend", "runtimes.gpu-8.backend", "backend=kubernetes"),
    ({"k8s_image": "docker.io/evil/miner:latest"}, "k8s_image", "runtimes.gpu-8.images", "'registry.example.com/ml/'"),
    ({"k8s_image": "registry.example.com/ml-other/x:1"}, "k8s_image", "runtimes.gpu-8.images", "matching"),
    ({"k8s_namespace": "kube-system"}, "k8s_namespace", "runtimes.gpu-8.namespaces", "one of 'team-a'"),
    ({"k8s_image_pull_secret": "other-pull"}, "k8s_image_pull_secret", "runtimes.gpu-8.image_pull_secret",
     "'team-a-pull'"),
    ({"k8s_node_selector": {"nvidia.com/gpu.product": "A100"}}, "k8s_node_selector", "runtimes.gpu-8.node_selector",
     "NVIDIA-H100-80GB-HBM3"),
    ({"k8s_nnodes": 5}, "k8s_nnodes", "ceilings of runtime gpu-8: nodes", "at most 4"),
    ({"k8s_gpus_per_node": 16}, "k8s_gpus_per_node", "ceilings of runtime gpu-8: gpus_per_node", "at most 8"),
    ({"k8s_memory_limit": "1Ti"}, "k8s_memory_limit", "ceilings of runtime gpu-8: memory_per_pod", "at most 512Gi"),
    ({"k8s_cpu_limit": "128"}, "k8s_cpu_limit", "ceilings of runtime gpu-8: cpu_per_pod", "at most 96"),
    ({"k8s_active_deadline_s": 90000}, "k8s_active_deadline_s", "ceilings of runtime gpu-8: wall_clock_s",
     "at most 86400"),
    ({"steps": 100001}, "steps", "ceilings of runtime gpu-8: steps", "at most 100000"),
    ({"model": "evil.payload:build"}, "model", "code.model_prefixes", "'team_models'"),
    ({"model": "team_models_evil:build"}, "model", "code.model_prefixes", "'team_models'"),
    ({"model": "hf:/home/someone/gpt2"}, "model", "code.hf_roots", "'s3://team-a-models'"),
    ({"dataset_uri": "/etc"}, "dataset_uri", "data.dataset_uri", "'/data', 's3://team-a-data'"),
    ({"dataset_uri": "/data/../etc/shadow"}, "dataset_uri", "data.dataset_uri", "'/data'"),
    ({"store_uri": "s3://other-team/ckpt"}, "store_uri", "data.store_uri", "'s3://team-a-ckpt'"),
    ({"store_uri": "s3://team-a-ckpt-copy/x"}, "store_uri", "data.store_uri", "'s3://team-a-ckpt'"),
    ({"store_uri": "file:///tmp/store"}, "store_uri", "data.store_uri", "'s3://team-a-ckpt'"),
    ({"tokenizer": "/home/someone/tokenizer.json"}, "tokenizer", "data.tokenizer", "'s3://team-a-models'"),
    ({"aws_conn_id": "platform_admin_s3"}, "aws_conn_id", "data.connections", "'team_a_s3'"),
    ({"k8s_data_pvc": "team-b-data"}, "k8s_data_pvc", "runtimes.gpu-8.pvcs", "one of 'team-a-data', 'team-a-ckpt'"),
    ({"k8s_checkpoint_pvc": "team-b-ckpt"}, "k8s_checkpoint_pvc", "runtimes.gpu-8.pvcs", "'team-a-ckpt'"),
])
def test_each_rule_refuses_naming_the_rule_the_value_and_what_is_allowed(team, change, field, rule, allowed):
    with pytest.raises(policy.PolicyError) as refused:
        policy.check({**GPU, **change}, team)
    message = str(refused.value)
    value = next(iter(change.values())) if len(change) == 1 else None
    assert refused.value.field == field and refused.value.rule == rule, message
    assert message.startswith(f"config field '{field}': {value!r} is refused by the deployment policy (rule {rule})")
    assert allowed in message.split("Fix: ", 1)[1], message


def test_a_local_run_is_bounded_by_its_runtime_ranks(team):
    with pytest.raises(policy.PolicyError, match=r"'world_size': 5 .*rule ceilings of runtime cpu: ranks.*at most 4"):
        policy.check({**CPU, "world_size": 5}, team)


def test_the_form_offers_the_runtimes_and_the_ceilings(team):
    params = training_params(["local", "kubernetes"], loaded=team)
    runtime = params["runtime"]
    assert runtime.schema["enum"] == ["cpu", "gpu-8"] and runtime.value == "cpu"
    assert params["steps"].schema["maximum"] == 100000
    assert params["k8s_nnodes"].schema["maximum"] == 4 and params["k8s_nnodes"].value == 2
    assert params["k8s_active_deadline_s"].schema["maximum"] == 86400
    assert params["world_size"].schema["maximum"] == 4  # local ranks: only the cpu runtime runs there
    permissive = training_params(["local"], loaded=policy.PERMISSIVE)
    assert permissive["runtime"].schema["enum"] == ["default"] and permissive["steps"].schema["maximum"] == 10_000_000


def test_the_pods_get_the_runtimes_placement_and_secrets(team, monkeypatch):
    from training_airflow.backends.kubernetes import spec

    monkeypatch.setattr(policy, "load", lambda path=None: team)
    params = {**{s.name: s.default for s in __import__("training_airflow.params", fromlist=["form_specs"])
                 .form_specs(["local", "kubernetes"])}, **GPU, "k8s_s3_secret": "someone-elses-s3"}
    kwargs = spec._common_pod_kwargs(params, SimpleNamespace(namespace="team-a"))
    assert kwargs["service_account_name"] == "team-a-trainer"
    assert [s.name for s in kwargs["image_pull_secrets"]] == ["team-a-pull"]
    assert kwargs["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec.s3_secret(params) == "team-a-s3"  # credentials never from a Param
    assert [(e.name, e.value_from.secret_key_ref.name) for e in spec.mlflow_env(params)] == [
        ("MLFLOW_TRACKING_USERNAME", "team-a-mlflow"), ("MLFLOW_TRACKING_PASSWORD", "team-a-mlflow")]


def test_open_run_checks_the_policy_before_any_user_code(tmp_path, monkeypatch):
    """A factory outside the allowed packages: open_run fails before the module is imported (its
    import would write a file) and before the MLflow run opens."""
    from airflow.sdk.exceptions import AirflowFailException

    from training_airflow import settings, tasks

    (tmp_path / "side_effect_models.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').write('imported')\ndef build(spec): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "policy.yaml"
    path.write_text("code: {model_prefixes: [team_models]}\n")
    monkeypatch.setenv(policy.ENV, str(path))
    monkeypatch.setattr(settings, "ensure_tracking_uri", lambda: pytest.fail("open_run went past the policy"))
    params = {s: p.value for s, p in training_params(["local"]).items()}
    params["model"] = "side_effect_models:build"
    with pytest.raises(AirflowFailException) as failed:
        tasks.open_run(params, dag_id="distributed_training", dag_run_id="manual__x",
                       dag_run=SimpleNamespace(conf={"model": "side_effect_models:build"}, run_id="manual__x"))
    assert "config field 'model': 'side_effect_models:build' is refused by the deployment policy (rule " \
           "code.model_prefixes)" in str(failed.value)
    assert not (tmp_path / "imported").exists()


def test_the_run_records_who_triggered_it_and_under_which_policy(team):
    tags = policy.record(team, "gpu-8", "alice")
    assert tags == {"policy.runtime": "gpu-8", "policy.sha256": team.sha256, "policy.source": team.source,
                    "airflow.triggered_by": "alice"}
    assert policy.record(team, "cpu", None)["airflow.triggered_by"] == "(no Airflow user)"  # scheduled, dag.test


def test_the_documented_example_is_a_valid_policy(tmp_path):
    """docs/operations.md's example for a team with a CPU and an 8-GPU runtime loads and bounds as it says."""
    import re

    from tests.conftest import ROOT

    text = (ROOT / "docs" / "operations.md").read_text()
    (example,) = re.findall(r"```yaml\n(# /etc/training/policy.yaml.*?)```", text, re.S)
    loaded = policy.parse(example, "docs/operations.md")
    assert list(loaded.policy.runtimes) == ["cpu", "gpu-8"]
    assert loaded.policy.ceilings_of("cpu").steps == 20000 and loaded.policy.ceilings_of("gpu-8").gpus == 32
    gpu = {**GPU, "k8s_namespace": "team-a", "dataset_uri": "s3://team-a-data/x", "store_uri": "s3://team-a-checkpoints",
           "model": "team_a_models.lm:build", "aws_conn_id": None, "k8s_checkpoint_pvc": "team-a-checkpoints",
           "tokenizer": "s3://team-a-models/tok/tokenizer.json"}
    assert policy.check(gpu, loaded) == "gpu-8"
    with pytest.raises(policy.PolicyError, match=r"empty value \(the worker's own keys\): this deployment lends no"):
        policy.check({**gpu, "aws_conn_id": "team_a_s3"}, loaded)
    with pytest.raises(policy.PolicyError, match=r"rule ceilings of runtime gpu-8: gpus_per_node\)"):
        policy.check({**gpu, "k8s_nnodes": 4, "k8s_gpus_per_node": 9}, loaded)


def test_the_api_servers_middleware_refuses_a_trigger_outside_the_policy(team, monkeypatch):
    """The DAG's defaults with the conf on top are checked, so a trigger with no conf is too; a
    DAG the policy does not bound passes (its own Airflow checks remain)."""
    import json

    from tests.plugins.test_conf_check import _request
    from training_airflow.conf_check import ConfCheck

    monkeypatch.setattr(policy, "load", lambda path=None: team)

    async def authorized(scope, dag_id):
        return True

    defaults = {**CPU, "world_size": 8}
    check = ConfCheck(None, declared=lambda app, dag_id: defaults, authorized=authorized)
    trigger = "/api/v2/dags/distributed_training/dagRuns"
    for conf in ({"steps": 10}, None):
        status, body, reached = _request(check, trigger, json.dumps({"conf": conf}).encode())
        assert (status, reached) == (400, []), body
        assert json.loads(body)["detail"].startswith("config field 'world_size': 8 is refused by the deployment "
                                                     "policy (rule ceilings of runtime cpu: ranks)")
    status, _, reached = _request(check, trigger, json.dumps({"conf": {"world_size": 2}}).encode())
    assert status == 200 and len(reached) == 1
    status, _, reached = _request(check, "/api/v2/dags/register_dataset/dagRuns", json.dumps({"conf": None}).encode())
    assert status == 200 and len(reached) == 1


def test_register_dataset_writes_only_where_the_policy_lets_datasets_be(team, tmp_path, monkeypatch):
    """register_dataset writes a folder then announces it: outside data.dataset_uri it is refused before
    anything is written, naming the rule."""
    from airflow.exceptions import AirflowFailException

    from training_airflow import dataset_tasks

    monkeypatch.setattr(policy, "load", lambda path=None: team)
    target = tmp_path / "elsewhere"
    params = {p: v.value for p, v in dataset_tasks.register_params().items()} | {"dataset_uri": str(target)}
    with pytest.raises(AirflowFailException, match=r"'dataset_uri'.*rule data.dataset_uri.*'/data', 's3://team-a-data'"):
        dataset_tasks.register_dataset(params)
    assert not target.exists()


def test_a_sweep_is_bounded_by_the_policys_sweeps_block():
    rules = policy.parse("sweeps: {trials: 20, parallel_trials: 2, total_steps: 4000}\n", "p.yaml")
    policy.check_sweep(20, 2, 200, rules)  # exactly at every bound
    for args, field, rule, allowed in (((21, 2, 100), "trials", "sweeps.trials", "at most 20"),
                                       ((10, 3, 100), "max_parallel_trials", "sweeps.parallel_trials", "at most 2"),
                                       ((12, 2, 400), "trials", "sweeps.total_steps", "at most 10 trials of 400 steps")):
        with pytest.raises(policy.PolicyError) as err:
            policy.check_sweep(*args, rules)
        assert (err.value.field, err.value.rule) == (field, rule) and allowed in str(err.value), str(err.value)
    policy.check_sweep(1000, 64, 10**6, policy.PERMISSIVE)  # no file: no bound
    with pytest.raises(policy.PolicyFileError, match="key sweeps.trial: is not a key of the policy"):
        policy.parse("sweeps: {trial: 3}\n", "p.yaml")
