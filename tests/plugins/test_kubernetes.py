"""The Kubernetes backend without a cluster: the Service, the Indexed Job and the upload pod are
built by the cncf-kubernetes provider's real operators (`build_job_request_obj`,
`build_pod_request_obj`), serialized by the Kubernetes client as it would send them, validated
against the Kubernetes 1.30 and newest OpenAPI schemas in strict mode (kubernetes-validate), and
then checked for what a schema cannot see.

The operators only need a kubeconfig to ask whether they run in a cluster; the one written here
points at https://127.0.0.1:1, where nothing listens, and nothing is ever sent there.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient

from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.operators.resource import (
    KubernetesCreateResourceOperator,
    KubernetesDeleteResourceOperator,
)
from airflow.sdk import TriggerRule
from tests.conftest import local_checkpoint
from training.config.fields import ConfigError
from training_airflow.backends.kubernetes import checks
from training_airflow.backends.kubernetes import operators as ops
from training_airflow.backends.kubernetes import spec as K
from training_airflow.params import training_params

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "5f3c2a9be1d04c7f8a6b0e2d4c6a8e10"
BOTH = ["local", "kubernetes"]
MLFLOW = "http://mlflow.mlops.svc:5000"
DAG_RUN_ID = "manual__2026-12-02T10:00:00+00:00"
K8S_VERSIONS = ["1.30.0", f"{kubernetes_validate.latest_version()}.0"]
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kube") / "config"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters: [{name: none, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: none, user: {token: not-a-token}}]\n"
        "contexts: [{name: none, context: {cluster: none, user: none}}]\ncurrent-context: none\n")
    return str(path)


def k8s_params(**overrides):
    params = {name: p.value for name, p in training_params(BOTH).items()}
    params.update(backend="kubernetes", store_uri="s3://checkpoints/team", k8s_mlflow_tracking_uri=MLFLOW,
                  k8s_nnodes=4, k8s_gpus_per_node=8, batch_size=256)
    params.update(overrides)
    return params


def serialize(obj) -> dict:
    return ApiClient().sanitize_for_serialization(obj)


def build_job(kubeconfig: str, params: dict, *, run_id: str = RUN_ID, try_number: int = 1, token_shards: str = ""):
    """Job + Names, built by the real KubernetesJobOperator from our arguments."""
    names = K.names(params, mlflow_run_id=run_id, try_number=try_number)
    cfg = K.pod_train_config(params, run_dir=names.run_dir, run_id=run_id, token_shards=token_shards)
    kwargs = K.job_operator_kwargs(params, names, mlflow_run_id=run_id, tracking_uri=MLFLOW, train_config=cfg,
                                   dag_run_id=DAG_RUN_ID)
    kwargs["kubernetes_conn_id"] = None  # no Airflow connection here: the kubeconfig file instead
    op = KubernetesJobOperator(task_id="train_on_kubernetes", in_cluster=False, config_file=kubeconfig,
                               **K.JOB_STATIC_KWARGS, **kwargs)
    return serialize(op.build_job_request_obj()), names


def build_upload_pod(kubeconfig: str, params: dict, *, run_id: str = RUN_ID):
    names = K.names(params, mlflow_run_id=run_id, try_number=1)
    kwargs = {**K.upload_pod_kwargs(params, names, mlflow_run_id=run_id), "kubernetes_conn_id": None}
    op = KubernetesPodOperator(task_id="upload_on_kubernetes", in_cluster=False, config_file=kubeconfig,
                               **K.POD_STATIC_KWARGS, **kwargs)
    return serialize(op.build_pod_request_obj()), names


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env") or []}


def torchrun_args(container: dict):
    """Parse the container's arguments with torchrun's own parser, as the pod will."""
    from torch.distributed.run import get_args_parser

    assert container["command"] == ["python", "-m", "training.distributed.elastic"]  # torchrun's agent, parsing torchrun's arguments
    return get_args_parser().parse_args(container["args"])


@pytest.fixture(scope="module")
def built(kubeconfig):
    """The objects of a run that keeps its checkpoints on the ReadWriteMany PVC (checkpoint_location=local)."""
    params = k8s_params(checkpoint_location="local")
    job, names = build_job(kubeconfig, params)
    pod, _ = build_upload_pod(kubeconfig, params)
    service = K.service_manifest(names)
    return SimpleNamespace(params=params, job=job, names=names, pod=pod, service=service,
                           spec=job["spec"]["template"]["spec"], template_labels=job["spec"]["template"]["metadata"]["labels"])


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_pass_the_strict_kubernetes_schemas(built, version):
    for obj in (built.service, built.job, built.pod):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_strict_schema_check_catches_mistakes(built):
    """Guards the test above: a misspelt field or a wrong type is refused."""
    typo = copy.deepcopy(built.job)
    typo["spec"]["completionsMode"] = "Indexed"
    wrong_type = copy.deepcopy(built.job)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["args"] = "torchrun --nnodes 2"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


# --------------------------------------------------------------------------- what a schema can't see


def test_indexed_job_with_one_pod_per_node(built):
    spec = built.job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == built.params["k8s_nnodes"] == 4
    assert spec["backoffLimit"] == built.params["k8s_backoff_limit"]
    assert spec["activeDeadlineSeconds"] == built.params["k8s_active_deadline_s"]
    assert spec["ttlSecondsAfterFinished"] == built.params["k8s_ttl_after_finished_s"]
    assert built.spec["restartPolicy"] == "Never"  # required by podFailurePolicy
    # Done when pod 0 is: after a scale-down the lost index can never succeed.
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    assert built.spec["terminationGracePeriodSeconds"] == built.params["k8s_termination_grace_s"]


def test_pod_failure_policy_fails_fast_on_bad_input_and_ignores_disruptions(built):
    from training.cli import EXIT_BAD_INPUT

    rules = built.job["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail == [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [EXIT_BAD_INPUT]}}]
    assert "containerName" not in fail[0]["onExitCodes"]  # applies to the init container too
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore == [
        # The launcher's exit code of a preempted pod (training/distributed/elastic.py), from the training container only.
        {"action": "Ignore", "onExitCodes": {"containerName": "base", "operator": "In", "values": [75]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]


def test_rendezvous_endpoint_is_pod_0s_name_as_the_provider_renders_it(built):
    job_name, ns = built.job["metadata"]["name"], built.job["metadata"]["namespace"]
    assert job_name.startswith("job-"), "the provider prefixes the Job name"
    assert job_name == built.names.job
    subdomain = built.spec["subdomain"]
    assert subdomain == built.service["metadata"]["name"]
    assert ns == built.service["metadata"]["namespace"] == built.params["k8s_namespace"]
    # An Indexed Job's pod i gets the hostname "<job name>-<i>"; with the subdomain its FQDN is:
    pod0 = f"{job_name}-0.{subdomain}.{ns}.svc.{built.params['k8s_cluster_domain']}"
    base = next(c for c in built.spec["containers"] if c["name"] == "base")
    args = torchrun_args(base)
    assert args.rdzv_endpoint == f"{pod0}:{built.params['k8s_rdzv_port']}"
    assert args.rdzv_backend == "c10d"
    assert args.nnodes == "4:4" and args.nproc_per_node == "8"
    assert args.max_restarts == built.params["max_restarts"]
    assert args.module and args.training_script == "training" and args.training_script_args[0] == "train"
    # The rendezvous port is the one the Service publishes.
    assert [p["port"] for p in built.service["spec"]["ports"]] == [built.params["k8s_rdzv_port"]]


def test_one_param_sets_the_preemption_window_of_every_layer(kubeconfig):
    """kubelet SIGKILL after terminationGracePeriodSeconds; the agent gives its ranks 5 s less
    (--shutdown-timeout); the ranks give up 5 s before that (preempt_grace_s). The run's own
    preempt_grace_s Param is the local backend's and does not reach the pods."""
    params = k8s_params(k8s_termination_grace_s=90, preempt_grace_s=600)
    job, _ = build_job(kubeconfig, params)
    spec = job["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 90
    args = torchrun_args(spec["containers"][0])
    assert args.shutdown_timeout == 85
    sets = dict(a.split("=", 1) for a in args.training_script_args[2::2])
    assert sets["preempt_grace_s"] == "80"
    assert "preempt_grace_s=80" in spec["initContainers"][0]["command"], "the init container checks the same config"
    assert (K.grace(params).pod_s, K.grace(params).agent_s, K.grace(params).rank_s) == (90, 85, 80)


@pytest.mark.parametrize("overrides, mesh", [
    ({"strategy": "fsdp"}, ("-1", "8")),  # 4 pods x 8 GPUs: shard within a pod, replicate across the pods
    ({"strategy": "fsdp", "k8s_gpus_per_node": 0, "batch_size": 64}, ("1", "-1")),  # CPU pods of one rank: across
    ({"strategy": "fsdp", "dp_replicate": -1, "dp_shard": 16}, ("-1", "16")),  # the user's own mesh is kept
    ({"strategy": "fsdp", "k8s_nnodes": 1}, ("1", "-1")),  # one pod: plain FSDP over its GPUs
    ({"strategy": "ddp"}, ("1", "-1")),
])
def test_multi_pod_fsdp_shards_within_a_pod_unless_told_otherwise(kubeconfig, overrides, mesh):
    job, _ = build_job(kubeconfig, k8s_params(**overrides))
    sets = dict(a.split("=", 1) for a in torchrun_args(job["spec"]["template"]["spec"]["containers"][0])
                .training_script_args[2::2])
    assert (sets["dp_replicate"], sets["dp_shard"]) == mesh


def test_rendezvous_timeouts_come_from_one_param(kubeconfig):
    from torch.distributed.run import _parse_rendezvous_config

    job, _ = build_job(kubeconfig, k8s_params(k8s_rdzv_timeout_s=120))
    args = torchrun_args(job["spec"]["template"]["spec"]["containers"][0])
    assert _parse_rendezvous_config(args.rdzv_conf) == {"join_timeout": "120", "read_timeout": "120",
                                                        "last_call_timeout": "5", "keep_alive_interval": "1",
                                                        "keep_alive_max_attempt": "3"}


def test_hostname_never_set_so_the_job_controller_names_the_pods(built):
    assert "hostname" not in built.spec or built.spec["hostname"] is None


def test_a_retry_gets_a_new_job_and_the_same_service(kubeconfig, built):
    job2, names2 = build_job(kubeconfig, built.params, try_number=2)
    assert job2["metadata"]["name"] != built.job["metadata"]["name"]
    assert names2.service == built.names.service
    assert torchrun_args(job2["spec"]["template"]["spec"]["containers"][0]).rdzv_endpoint.startswith(
        f"{job2['metadata']['name']}-0.")


def test_names_are_valid_dns(kubeconfig):
    params = k8s_params(k8s_nnodes=256, k8s_gpus_per_node=1, k8s_namespace="a" * 63)
    job, names = build_job(kubeconfig, params, run_id="F" * 32, try_number=99)
    assert DNS_1035_LABEL.match(names.service) and len(names.service) <= 63
    assert DNS_1123_SUBDOMAIN.match(job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    for index in (0, 255):  # every pod hostname is a DNS label
        host = names.pod_hostname(index)
        assert DNS_1123_LABEL.match(host) and len(host) <= 63, host
    assert DNS_1123_SUBDOMAIN.match(names.rdzv_host) and len(names.rdzv_host) <= 253
    assert DNS_1123_LABEL.match(names.upload_pod)


def test_the_service_selects_exactly_this_runs_training_pods(kubeconfig, built):
    svc = built.service["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    selector = svc["selector"]
    assert selector and selector.items() <= built.template_labels.items()
    # Not the upload pod, not another run's training pods.
    assert not selector.items() <= built.pod["metadata"]["labels"].items()
    other, _ = build_job(kubeconfig, built.params, run_id="0" * 32)
    assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()


def test_gpu_limits_and_resources_come_from_the_params(kubeconfig, built):
    res = built.spec["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "8"
    assert res["requests"] == {"cpu": built.params["k8s_cpu_request"], "memory": built.params["k8s_memory_request"]}
    assert res["limits"]["cpu"] == built.params["k8s_cpu_limit"] and res["limits"]["memory"] == built.params["k8s_memory_limit"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in built.spec["tolerations"]
    assert "nvidia.com/gpu" not in json.dumps(built.pod), "the upload pod needs no GPU"

    cpu_job, _ = build_job(kubeconfig, k8s_params(k8s_gpus_per_node=0, batch_size=64))
    cpu = cpu_job["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
    assert torchrun_args(cpu["containers"][0]).nproc_per_node == "1"
    assert not cpu.get("tolerations")


def test_env_wiring(built):
    env = env_of(built.spec["containers"][0])
    assert env["MLFLOW_TRACKING_URI"]["value"] == MLFLOW
    assert env["MLFLOW_RUN_ID"]["value"] == RUN_ID
    for name, optional in K.S3_ENV.items():
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert "value" not in env[name]
        assert ref == {"name": built.params["k8s_s3_secret"], "key": name, "optional": optional}
    for name, value in built.params["k8s_nccl_env"].items():
        assert env[name]["value"] == value
    upload_env = env_of(built.pod["spec"]["containers"][0])
    assert all(upload_env[n]["valueFrom"]["secretKeyRef"]["name"] == built.params["k8s_s3_secret"] for n in K.S3_ENV)


def test_every_rank_serves_metrics_on_a_named_port_the_podmonitor_scrapes(built, kubeconfig):
    import yaml

    from training.metrics.live import DAG_RUN_ENV, EXPERIMENT_ENV, NODE_ENV

    container = built.spec["containers"][0]
    base = built.params["metrics_port"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {f"metrics-{i}": base + i for i in range(8)}  # 8 GPUs: 8 ranks a pod, each its own port
    annotations = built.job["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(base), "prometheus.io/path": "/metrics"}
    env = env_of(container)
    assert env[K.POD_IP_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[NODE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env[EXPERIMENT_ENV]["value"] == built.params["experiment"] and env[DAG_RUN_ENV]["value"] == DAG_RUN_ID
    # The ranks listen on the pod's IP: $(POD_IP) left for Kubernetes to expand, once.
    sets = torchrun_args(container).training_script_args
    assert [a for a in sets if a.startswith("metrics_host=")] == ["metrics_host=$(POD_IP)"]
    # The PodMonitor beside the Job's manifests selects these pods and names every port they declare.
    (monitor,) = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["metadata"]["namespace"] == built.params["k8s_namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= built.template_labels.items()
    assert set(ports) <= {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    # metrics_port=0: no port, no annotation, no pod-IP override.
    job, _ = build_job(kubeconfig, k8s_params(checkpoint_location="local", metrics_port=0))
    off = job["spec"]["template"]["spec"]["containers"][0]
    assert not off.get("ports") and not (job["spec"]["template"]["metadata"].get("annotations") or {})
    assert "metrics_host=$(POD_IP)" not in off["args"]


def test_no_secret_value_reaches_the_rendered_objects(kubeconfig, monkeypatch):
    secrets = {"AWS_ACCESS_KEY_ID": "AKIAWORKERKEY123", "AWS_SECRET_ACCESS_KEY": "worker-secret-value-9f8e7d",
               "MLFLOW_TRACKING_PASSWORD": "mlflow-password-4242"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    params = k8s_params()
    job, names = build_job(kubeconfig, params)
    pod, _ = build_upload_pod(kubeconfig, params)
    text = json.dumps([job, pod, K.service_manifest(names)])
    for value in secrets.values():
        assert value not in text
    with pytest.raises(ConfigError, match="k8s_mlflow_tracking_uri.*credentials"):
        checks.pod_tracking_uri(k8s_params(k8s_mlflow_tracking_uri="https://user:pw@mlflow.example"), None)


def test_volumes_shm_and_checkpoint_folder(built):
    vols = {v["name"]: v for v in built.spec["volumes"]}
    mounts = {m["name"]: m for m in built.spec["containers"][0]["volumeMounts"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == built.params["k8s_checkpoint_pvc"]
    assert mounts["checkpoints"]["mountPath"] == K.CHECKPOINT_MOUNT and not mounts["checkpoints"]["readOnly"]
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": built.params["k8s_data_pvc"], "readOnly": True}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": built.params["k8s_shm_size"]}
    # The trainer writes its checkpoints into this run's folder on the shared volume.
    sets = dict(a.split("=", 1) for a in torchrun_args(built.spec["containers"][0]).training_script_args[2::2])
    assert sets["checkpoint_dir"] == f"/checkpoints/{built.params['experiment']}/{RUN_ID}/checkpoints"
    assert sets["dataset_uri"] == built.params["k8s_dataset_path"]
    # The upload pod reads the same volume, read-only, at the same place.
    pod_mounts = {m["name"]: m for m in built.pod["spec"]["containers"][0]["volumeMounts"]}
    assert pod_mounts["checkpoints"] == {"name": "checkpoints", "mountPath": K.CHECKPOINT_MOUNT, "readOnly": True}


def test_security_context(built):
    for spec in (built.spec, built.pod["spec"]):
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in [*spec["containers"], *(spec.get("initContainers") or [])]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, c["name"]
            assert csc["readOnlyRootFilesystem"] is True, c["name"]
            assert csc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp"}, "a writable /tmp on a read-only root"


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_the_init_container_runs_the_trainers_config_check_with_the_same_config(built, tmp_path):
    """`train --print-config` with the pods' arguments succeeds, and bad input exits with the
    code the FailJob rule matches (run for real: the same CLI the image runs)."""
    (init,) = built.spec["initContainers"]
    assert init["name"] == K.CHECK_CONTAINER and init["command"][:5] == ["python", "-m", "training", "train", "--print-config"]
    base_sets = torchrun_args(built.spec["containers"][0]).training_script_args[1:]
    assert init["command"][5:] == base_sets, "the init container checks exactly what the ranks will run"

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, *init["command"][1:]], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["checkpoint_dir"].startswith("/checkpoints/")
    bad = [a if not a.startswith("lr=") else "lr=-1" for a in init["command"][1:]]
    refused = subprocess.run([sys.executable, *bad], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    rules = built.job["spec"]["podFailurePolicy"]["rules"]
    assert refused.returncode in rules[0]["onExitCodes"]["values"], refused.stderr
    assert "lr" in refused.stderr


def test_upload_pod_commits_the_final_checkpoint(built):
    from training.cli import build_parser

    c = built.pod["spec"]["containers"][0]
    assert c["name"] == "base" and c["image"] == built.params["k8s_image"]
    a = build_parser().parse_args(c["command"][3:] + c["args"])
    assert a.command == "upload"
    assert a.checkpoint == f"/checkpoints/{built.params['experiment']}/{RUN_ID}/checkpoints/step_{built.params['steps']:08d}"
    assert (a.store_uri, a.experiment, a.run_id) == (built.params["store_uri"], built.params["experiment"], RUN_ID)


@pytest.fixture(scope="module")
def in_store(kubeconfig):
    """The objects of a run whose ranks commit their checkpoints to the store (the default)."""
    params = k8s_params()
    assert params["checkpoint_location"] == "store"
    job, names = build_job(kubeconfig, params)
    return SimpleNamespace(params=params, job=job, spec=job["spec"]["template"]["spec"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_checkpoints_in_the_store_need_no_volume_and_no_upload_pod(in_store, version):
    kubernetes_validate.validate(in_store.job, version, strict=True)
    vols = {v["name"]: v for v in in_store.spec["volumes"]}
    assert "checkpoints" not in vols, "no ReadWriteMany checkpoint volume"
    assert [v["persistentVolumeClaim"]["claimName"] for v in vols.values() if "persistentVolumeClaim" in v] == [
        in_store.params["k8s_data_pvc"]]
    assert vols["tmp"]["emptyDir"] == {"sizeLimit": in_store.params["k8s_scratch_size"]}  # the spool
    sets = dict(a.split("=", 1) for a in torchrun_args(in_store.spec["containers"][0]).training_script_args[2::2])
    assert sets["checkpoint_dir"] == f"s3://checkpoints/team/{in_store.params['experiment']}/{RUN_ID}"
    assert sets["output_dir"] == "/tmp/output"
    env = env_of(in_store.spec["containers"][0])
    assert all(env[n]["valueFrom"]["secretKeyRef"]["name"] == in_store.params["k8s_s3_secret"] for n in K.S3_ENV)
    # The upload task skips itself: nothing to upload, the ranks committed the final checkpoint.
    from airflow.sdk.exceptions import AirflowSkipException

    up = ops.UploadPodOperator(task_id="upload_on_kubernetes", handoff={"mlflow_run_id": RUN_ID})
    with pytest.raises(AirflowSkipException, match="the ranks committed the final checkpoint"):
        up.execute({"params": in_store.params, "ti": SimpleNamespace(try_number=1)})


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_a_text_run_reads_the_token_windows_the_tokenize_task_wrote(kubeconfig, version):
    params = k8s_params(dataset_uri="s3://corpus/help", text_column="text", tokenizer="bpe:1024", seq_len=256,
                        model="transformer", activation_checkpointing="full")
    shards = "s3://checkpoints/team/tokens/5d41402abc4b2a76"
    job, _ = build_job(kubeconfig, params, token_shards=shards)
    kubernetes_validate.validate(job, version, strict=True)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    sets = dict(a.split("=", 1) for a in torchrun_args(container).training_script_args[2::2])
    assert sets["token_shards"] == shards and sets["dataset_uri"] == "s3://corpus/help"
    assert (sets["text_column"], sets["seq_len"], sets["activation_checkpointing"]) == ("text", "256", "full")
    init = job["spec"]["template"]["spec"]["initContainers"][0]
    assert f"token_shards={shards}" in init["command"], "the pre-start check reads the same windows"


def test_an_sft_run_with_lora_hands_the_pods_its_columns_and_adapter(kubeconfig):
    """SFT under the kubernetes backend: the tokenize task renders and packs on the worker; the pods get
    the same fields (the columns label the windows' answers, the adapter and its export)."""
    params = k8s_params(dataset_uri="s3://corpus/instructions", messages_column="messages", model="hf:/models/my-llama",
                        adapter="lora", lora_targets="all-linear", merge_adapter=False, seq_len=256, strategy="fsdp")
    shards = "s3://checkpoints/team/tokens/0a1b2c3d4e5f6071"
    job, _ = build_job(kubeconfig, params, token_shards=shards)
    kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    sets = dict(a.split("=", 1) for a in torchrun_args(container).training_script_args[2::2])
    assert sets["token_shards"] == shards and sets["messages_column"] == "messages"
    assert (sets["adapter"], sets["lora_targets"], sets["merge_adapter"]) == ("lora", "all-linear", "false"), sets
    assert not sets.get("text_column") and not sets.get("prompt_column"), sets


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_the_init_container_checks_the_store_with_the_pods_secret(in_store, s3_server, tmp_path):
    """In the store case `check-config` also lists and writes the run's place in the bucket, with
    the same Secret as the ranks: a missing bucket fails the Job at once (exit code 2, FailJob)."""
    (init,) = in_store.spec["initContainers"]
    assert init["command"][:6] == ["python", "-m", "training", "train", "--print-config", "--check-access"]
    env_refs = env_of(init)
    assert all(env_refs[n]["valueFrom"]["secretKeyRef"]["name"] == in_store.params["k8s_s3_secret"] for n in K.S3_ENV)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # AWS_ENDPOINT_URL: moto, as the Secret would say
    missing = subprocess.run([sys.executable, *init["command"][1:]], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=120)
    assert missing.returncode in in_store.job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]
    assert "bucket 'checkpoints' does not exist (list team/" in missing.stderr, missing.stderr
    import boto3

    boto3.client("s3", endpoint_url=s3_server["endpoint"]).create_bucket(Bucket="checkpoints")
    ok = subprocess.run([sys.executable, *init["command"][1:]], capture_output=True, text=True, env=env, cwd=tmp_path,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["checkpoint_dir"].startswith("s3://checkpoints/team/")


def test_dollar_parentheses_are_escaped_for_kubernetes():
    assert K.set_args({"dataset_uri": "/data/$(HOME)"}) == ["--set", "dataset_uri=/data/$$(HOME)"]


# --------------------------------------------------------------------------- run-time arguments


def _context(params, try_number=1):
    return {"params": params, "ti": SimpleNamespace(try_number=try_number), "run_id": DAG_RUN_ID}


def test_operators_compute_their_arguments_when_the_task_runs(kubeconfig, monkeypatch):
    """The DAG's operators get their arguments at run time (apply_kwargs); the result must be the
    same objects as passing those arguments to the provider's constructor."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", MLFLOW)
    params = k8s_params()
    op = ops.TrainingJobOperator(task_id="train_on_kubernetes", handoff={"mlflow_run_id": RUN_ID},
                               in_cluster=False, config_file=kubeconfig)
    names = op.prepare(_context(params))
    assert names == K.names(params, mlflow_run_id=RUN_ID, try_number=1)
    op.kubernetes_conn_id = None
    at_runtime = serialize(op.build_job_request_obj())
    expected, _ = build_job(kubeconfig, params)
    assert at_runtime == expected

    up = ops.UploadPodOperator(task_id="upload_on_kubernetes", handoff={"mlflow_run_id": RUN_ID},
                             in_cluster=False, config_file=kubeconfig)
    up.prepare(_context(params))
    up.kubernetes_conn_id = None
    got, want = serialize(up.build_pod_request_obj()), build_upload_pod(kubeconfig, params)[0]
    for obj in (got, want):  # the provider adds a random suffix to pod names
        obj["metadata"]["name"] = re.sub(r"-[a-z0-9]{8}$", "", obj["metadata"]["name"])
    assert got == want


def test_apply_kwargs_refuses_unknown_arguments():
    op = KubernetesPodOperator(task_id="x")
    with pytest.raises(AttributeError, match="completionz"):
        ops.apply_kwargs(op, {"completionz": 2})


def test_operators_are_the_providers():
    assert issubclass(ops.TrainingJobOperator, KubernetesJobOperator)
    assert issubclass(ops.UploadPodOperator, KubernetesPodOperator)
    assert issubclass(ops.RendezvousServiceOperator, KubernetesCreateResourceOperator)
    assert issubclass(ops.DeleteRendezvousServiceOperator, KubernetesDeleteResourceOperator)


def test_service_creation_fails_when_the_cluster_is_unreachable(kubeconfig, monkeypatch):
    """The provider's create operator reports success after retrying a failed call (its retry gets
    an exhausted generator); ours reads the Service back, so the task fails. The 'cluster' is
    https://127.0.0.1:1, where the connection is refused."""
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_NOWHERE", json.dumps(
        {"conn_type": "kubernetes", "extra": {"kube_config_path": kubeconfig}}))
    op = ops.RendezvousServiceOperator(task_id="create_rendezvous_service", handoff={"mlflow_run_id": RUN_ID})
    with pytest.raises(Exception, match="127.0.0.1"):
        op.execute(_context(k8s_params(kubernetes_conn_id="kubernetes_nowhere")))
    assert "kind: Service" in op.yaml_conf and "clusterIP: None" in op.yaml_conf.replace("'", "")


# --------------------------------------------------------------------------- checks before launch


@pytest.mark.parametrize("overrides, field", [
    ({"store_uri": "file:///var/store"}, "store_uri"),
    ({"k8s_min_nodes": 5}, "k8s_min_nodes"),
    ({"k8s_cpu_request": "16"}, "k8s_cpu_limit"),
    ({"k8s_memory_request": "64Gi"}, "k8s_memory_limit"),
    ({"k8s_shm_size": "64Gi"}, "k8s_shm_size"),
    ({"k8s_mlflow_tracking_uri": "http://127.0.0.1:5000"}, "k8s_mlflow_tracking_uri"),
    ({"k8s_mlflow_tracking_uri": "http://localhost:5000"}, "k8s_mlflow_tracking_uri"),
    ({"batch_size": 100}, "batch_size"),  # 4 nodes x 8 GPUs = 32 ranks
    ({"k8s_min_nodes": 3, "max_restarts": 1, "batch_size": 64}, "batch_size"),  # 3 x 8 = 24 ranks is possible too
    ({"k8s_min_nodes": 3}, "max_restarts"),  # going on with 3 pods is a restart: none allowed
    ({"k8s_nccl_env": {"LD_PRELOAD": "/x.so"}}, "k8s_nccl_env"),
    ({"k8s_dataset_path": "/data/../etc"}, "k8s_dataset_path"),
])
def test_bad_kubernetes_params_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        checks.check_params(k8s_params(**overrides), worker_tracking_uri=MLFLOW)
    assert f"'{field}'" in str(e.value) and "Fix:" in str(e.value)


def test_the_worker_must_log_to_the_server_the_pods_use():
    with pytest.raises(ConfigError, match="worker's MLFLOW_TRACKING_URI") as e:
        checks.check_params(k8s_params(), worker_tracking_uri="sqlite:////secret/path/mlflow.db")
    checks.check_params(k8s_params(), worker_tracking_uri=MLFLOW)
    checks.check_params(k8s_params(k8s_mlflow_tracking_uri=""), worker_tracking_uri=MLFLOW)
    with pytest.raises(ConfigError) as e:
        checks.pod_tracking_uri(k8s_params(k8s_mlflow_tracking_uri=""), "postgresql://u:topsecret@db/mlflow")
    assert "topsecret" not in str(e.value)


def test_an_elastic_run_is_accepted_with_restarts():
    assert checks.check_params(k8s_params(k8s_min_nodes=2, max_restarts=2, batch_size=192),
                               worker_tracking_uri=MLFLOW) == 32


def test_params_schema_refuses_bad_names_before_a_run_is_created():
    from airflow.sdk.definitions.param import ParamValidationError

    p = training_params(BOTH)
    for name, bad in [("k8s_namespace", "Training_NS"), ("k8s_cpu_limit", "8 cores"), ("backend", "slurm"),
                      ("k8s_checkpoint_pvc", "-pvc"), ("k8s_nccl_env", {"PATH": "/bin"}),
                      ("k8s_mlflow_tracking_uri", "sqlite:///x.db"), ("k8s_termination_grace_s", 10)]:
        with pytest.raises(ParamValidationError):
            p[name].resolve(bad)


# --------------------------------------------------------------------------- worker side


def test_job_wall_time_from_the_job_status():
    from datetime import datetime, timezone

    start = datetime(2026, 1, 1, 10, 0, tzinfo=timezone.utc)
    job = {"status": {"start_time": start, "completion_time": start.replace(minute=42)}}
    assert K.job_wall_s(job) == 42 * 60
    assert K.job_wall_s({"status": {"start_time": "2026-01-01T10:00:00Z", "completion_time": "2026-01-01T10:00:30Z"}}) == 30
    assert K.job_wall_s(None) == 0.0


def test_committed_handoff_reads_the_commit_back_from_s3(s3_server, tmp_path):
    """What upload_checkpoint hands on after the upload pod: read from a real S3 API (moto's
    server on 127.0.0.1), written by the same upload code the pod runs."""
    import boto3

    from training.checkpoint.commit import upload_checkpoint

    boto3.client("s3", endpoint_url=s3_server["endpoint"]).create_bucket(Bucket="checkpoints")
    params = k8s_params(steps=120)
    step = local_checkpoint(tmp_path, 120, {"model.safetensors": b"weights"}, world_size=32)
    upload_checkpoint(step, params["store_uri"], experiment=params["experiment"], run_id=RUN_ID)

    job = {"status": {"start_time": "2026-01-01T10:00:00Z", "completion_time": "2026-01-01T10:05:00Z"}}
    opened = {"mlflow_run_id": RUN_ID, "dataset_uri": "/data/teacher", "dataset_fingerprint": "f1e2"}
    h = ops.committed_handoff(params, opened, job=job)
    assert h == {**opened, "final_step": 120, "torchrun_wall_s": 300.0,
                 "checkpoint_uri": f"s3://checkpoints/team/{params['experiment']}/{RUN_ID}/step_00000120"}
    with pytest.raises(RuntimeError, match="does not exist"):
        ops.committed_handoff(params, {**opened, "mlflow_run_id": "0" * 32}, job=job)


def test_committed_handoff_reads_the_store_through_the_runs_aws_connection(s3_server, monkeypatch, tmp_path):
    """Same store settings as the local backend: the Airflow connection named in aws_conn_id. The
    worker's own AWS_ENDPOINT_URL points at a closed port, so only the connection can succeed."""
    import boto3

    from tests.conftest import free_port
    from training.checkpoint.commit import upload_checkpoint

    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="conn-bucket")
    params = k8s_params(steps=10, store_uri="s3://conn-bucket/p", aws_conn_id="ckpt_s3")
    step = local_checkpoint(tmp_path, 10, {"model.safetensors": b"w"}, world_size=2)
    upload_checkpoint(step, params["store_uri"], experiment=params["experiment"], run_id=RUN_ID)

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_S3", json.dumps({
        "conn_type": "aws", "login": "testing", "password": "testing",
        "extra": {"endpoint_url": s3_server["endpoint"], "region_name": "us-east-1"}}))
    opened = {"mlflow_run_id": RUN_ID, "dataset_uri": "/data/teacher", "dataset_fingerprint": "f"}
    h = ops.committed_handoff(params, opened, job=None)
    assert h["checkpoint_uri"] == f"s3://conn-bucket/p/{params['experiment']}/{RUN_ID}/step_00000010"


# --------------------------------------------------------------------------- pods that cannot start


def _pod(name="job-train-x-1-0", phase="Pending", conditions=(), waiting=None, terminated=None, started=None,
         selector=None):
    from kubernetes.client import models as k8s

    state = k8s.V1ContainerState(waiting=waiting, terminated=terminated)
    status = k8s.V1ContainerStatus(name="base", image="registry.example/dt:1", image_id="", ready=False,
                                   restart_count=0, state=state)
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name), spec=k8s.V1PodSpec(containers=[], node_selector=selector),
                     status=k8s.V1PodStatus(phase=phase, conditions=list(conditions), start_time=started,
                                            container_statuses=[status] if (waiting or terminated) else None))


def test_a_node_selector_nothing_matches_fails_after_the_startup_timeout():
    from datetime import datetime, timedelta, timezone

    from kubernetes.client import models as k8s

    from training_airflow.backends.kubernetes import watch

    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    msg = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    cond = lambda ago: k8s.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",  # noqa: E731
                                          message=msg, last_transition_time=now - timedelta(seconds=ago))
    sel = {"gpu": "h100"}
    assert watch.stuck([_pod(conditions=[cond(100)], selector=sel)], now=now, timeout_s=300) is None
    cause = watch.stuck([_pod(conditions=[cond(301)], selector=sel)], now=now, timeout_s=300)
    assert "could not be scheduled for 301s" in cause and msg in cause and "{'gpu': 'h100'}" in cause
    assert "k8s_node_selector" in cause


def test_an_image_that_cannot_be_pulled_fails_naming_the_image():
    from datetime import datetime, timedelta, timezone

    from kubernetes.client import models as k8s

    from training_airflow.backends.kubernetes import watch

    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    backoff = k8s.V1ContainerStateWaiting(reason="ImagePullBackOff", message='Back-off pulling image "registry.example/dt:1"')
    assert watch.stuck([_pod(waiting=backoff, started=now - timedelta(seconds=30))], now=now, timeout_s=120) is None
    cause = watch.stuck([_pod(waiting=backoff, started=now - timedelta(seconds=121))], now=now, timeout_s=120)
    assert "ImagePullBackOff" in cause and "registry.example/dt:1" in cause and "k8s_image" in cause
    invalid = k8s.V1ContainerStateWaiting(reason="InvalidImageName", message="couldn't parse image reference")
    assert "InvalidImageName" in watch.stuck([_pod(waiting=invalid, started=now)], now=now, timeout_s=120)
    secret = k8s.V1ContainerStateWaiting(reason="CreateContainerConfigError", message='secret "training-s3" not found')
    assert "k8s_s3_secret" in watch.stuck([_pod(waiting=secret, started=now - timedelta(seconds=500))], now=now,
                                          timeout_s=120)
    running = _pod(phase="Running", waiting=backoff, started=now - timedelta(days=1))
    assert watch.stuck([running], now=now, timeout_s=120) is None


def test_a_failed_job_is_reported_with_what_its_pods_said():
    from kubernetes.client import models as k8s

    from training_airflow.backends.kubernetes import watch

    said = "elastic: cannot reach the rendezvous store at job-0.rdzv:29400 within read_timeout=60s; exit 1"
    pods = [_pod(phase="Failed", terminated=k8s.V1ContainerStateTerminated(exit_code=1, message=f"log\n{said}")),
            _pod(name="job-train-x-1-1", phase="Succeeded",
                 terminated=k8s.V1ContainerStateTerminated(exit_code=0, message="done"))]
    assert watch.failure(pods) == f"pod job-train-x-1-0 container base exited 1: {said}"
    assert "no failed pod" in watch.failure([])


def test_the_job_wait_gives_up_when_the_pods_cannot_start(kubeconfig, monkeypatch):
    """The hook's wait reads the Job's pods at each poll (the provider's loop otherwise waits for
    the Job's deadline). The API calls are replaced by the answers a cluster gives."""
    from kubernetes.client import models as k8s

    from training_airflow.backends.kubernetes import watch

    op = ops.TrainingJobOperator(task_id="train_on_kubernetes", handoff={"mlflow_run_id": RUN_ID},
                                 in_cluster=False, config_file=kubeconfig, kubernetes_conn_id=None)
    hook = op.hook
    assert isinstance(hook, watch.WatchedHook)
    running = k8s.V1Job(status=k8s.V1JobStatus(active=2))
    polls = []
    monkeypatch.setattr(hook, "get_job_status", lambda job_name, namespace: running)
    monkeypatch.setattr(hook, "job_pods", lambda job_name, namespace: polls.append(1) or [_pod()])
    monkeypatch.setattr(watch, "sleep", lambda s: None)
    hook.check = lambda pods: "pod cannot start" if len(polls) >= 3 else None
    with pytest.raises(watch.PodsCannotStart, match="pod cannot start"):
        hook.wait_until_job_complete("job-train-x-1", "training", job_poll_interval=1)
    assert len(polls) == 3
    done = k8s.V1Job(metadata=k8s.V1ObjectMeta(name="job-train-x-1"),
                     status=k8s.V1JobStatus(conditions=[k8s.V1JobCondition(type="Complete", status="True")]))
    monkeypatch.setattr(hook, "get_job_status", lambda job_name, namespace: done)
    assert hook.wait_until_job_complete("job-train-x-1", "training") is done


# --------------------------------------------------------------------------- DAG wiring


@pytest.fixture
def dag(monkeypatch):
    """The DAG of a deployment that offers both backends (TRAINING_BACKENDS, read at parse time)."""
    from tests.conftest import load_dag

    monkeypatch.setenv("TRAINING_BACKENDS", "local,kubernetes")
    return load_dag("distributed_training")


def test_each_backend_is_a_task_group_and_a_branch_picks_one(dag):
    t = dag.task_dict
    local = ["train", "upload_checkpoint"]
    k8s = ["create_rendezvous_service", "train_on_kubernetes", "upload_on_kubernetes", "delete_rendezvous_service",
           "confirm_commit"]
    assert set(t) == {"open_run", "validate_data", "tokenize", "choose_backend", *local, *k8s, "trained", "evaluate", "register", "report"}
    assert {t[x].task_group.group_id for x in local} == {"local"}
    assert {t[x].task_group.group_id for x in k8s} == {"kubernetes"}
    assert t["choose_backend"].downstream_task_ids == {"train", "create_rendezvous_service"}
    assert "tokenize" in t["choose_backend"].upstream_task_ids
    assert t["validate_data"].upstream_task_ids == {"open_run"} and t["tokenize"].upstream_task_ids == {"validate_data"}
    assert t["train_on_kubernetes"].upstream_task_ids >= {"create_rendezvous_service", "tokenize"}
    assert t["upload_on_kubernetes"].upstream_task_ids >= {"train_on_kubernetes"}
    # The Service is the Job's setup/teardown: deleted whatever happened once it was created.
    assert t["create_rendezvous_service"].is_setup and t["delete_rendezvous_service"].is_teardown
    assert t["delete_rendezvous_service"].trigger_rule == TriggerRule.ALL_DONE_SETUP_SUCCESS
    assert t["delete_rendezvous_service"].upstream_task_ids >= {"train_on_kubernetes", "create_rendezvous_service"}
    assert t["trained"].upstream_task_ids == {"upload_checkpoint", "confirm_commit"}
    # With the checkpoints in the store the upload pod is skipped; the commit is read back all the same.
    assert t["confirm_commit"].trigger_rule == TriggerRule.NONE_FAILED
    assert t["trained"].trigger_rule == TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS
    assert t["evaluate"].upstream_task_ids == {"trained"}
    assert "k8s_nnodes" in dag.params and dag.params.get_param("backend").schema["enum"] == ["local", "kubernetes"]


def test_a_local_only_deployment_has_no_kubernetes_tasks_or_fields(monkeypatch):
    from tests.conftest import load_dag

    monkeypatch.setenv("TRAINING_BACKENDS", "local")
    dag = load_dag("distributed_training")
    assert set(dag.task_dict) == {"open_run", "validate_data", "tokenize", "train", "upload_checkpoint", "evaluate", "register", "report"}
    assert not [p for p in dag.params if p.startswith("k8s_")]
    assert dag.params.get_param("backend").schema["enum"] == ["local"]
