"""The Kubernetes backend's pods, run for real on podman.

The Service, the Indexed Job and the upload pod are rendered by the DAG's own operators (their
``prepare``, then the provider's ``build_*_request_obj``: exactly what ``execute`` would send);
the worker-side tasks are the DAG's own task bodies (``validate_data``, ``confirm_commit``,
``evaluate``). What a control plane would do in between (the Job controller, the scheduler, the
kubelet, the Service's DNS) is played by tests/e2e/pods.py, which says how; everything inside the
pods is real: the image, torchrun's c10d rendezvous between two pods, gloo, a real MLflow server
on 127.0.0.1 and moto's S3 server over HTTP.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
import yaml
from kubernetes.client import ApiClient
from mlflow.tracking import MlflowClient

from tests.e2e.pods import Cluster, PlayedJob, standalone_pod
from training.util import free_port

NAMESPACE = "training"
# What the local backend logs for the same run (docs/architecture.md, "Metrics (one schema)").
SCHEMA = {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s", "perf/step_s", "perf/data_wait_s",
          "perf/mfu", "comm/s_per_step", "comm/exposed_s_per_step", "comm/exposed_fraction", "comm/bytes_per_step",
          "comm/collectives_per_step", "mem/state_bytes_per_rank", "goodput", "summary/wall_s",
          "summary/productive_s", "summary/device_hours", "summary/total_samples", "mem/peak_bytes_max",
          "pipeline/torchrun_wall_s", "eval/loss", "eval/accuracy"}


def _kubeconfig(root: Path) -> Path:
    """The cluster connection the operators need to build their objects; nothing is ever sent."""
    path = root / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\n"
                    "clusters: [{name: none, cluster: {server: 'https://127.0.0.1:1'}}]\n"
                    "users: [{name: none, user: {token: not-a-token}}]\n"
                    "contexts: [{name: none, context: {cluster: none, user: none}}]\ncurrent-context: none\n")
    return path


class PodsRun:
    """One DAG run of the kubernetes backend: its Params, the worker's tasks, the played cluster."""

    def __init__(self, *, engine, image: str, root: Path, dataset: Path, s3: dict, mlflow: dict, monkeypatch,
                 **overrides: Any) -> None:
        from tests.conftest import load_dag
        from training_airflow.params import training_params

        tag = secrets.token_hex(4)  # names of this run's volumes and Secret on the machine
        monkeypatch.setenv("TRAINING_BACKENDS", "local,kubernetes")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow["worker_uri"])
        monkeypatch.setenv("AIRFLOW_CONN_KUBE_PODS_TEST", json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(_kubeconfig(root))}}))
        import mlflow as mlflow_module

        mlflow_module.set_tracking_uri(mlflow["worker_uri"])
        self.params = {name: p.value for name, p in training_params(["local", "kubernetes"]).items()}
        self.params.update(
            backend="kubernetes", experiment="pods", dataset_uri=str(dataset), store_uri="s3://pods/team",
            kubernetes_conn_id="kube_pods_test", k8s_namespace=NAMESPACE, k8s_image=image, k8s_nnodes=2,
            k8s_gpus_per_node=0, k8s_cpu_request="500m", k8s_cpu_limit="1", k8s_memory_request="1Gi",
            k8s_memory_limit="3Gi", k8s_shm_size="256Mi", k8s_checkpoint_pvc=f"ckpt-{tag}", k8s_data_pvc=f"data-{tag}",
            k8s_s3_secret=f"s3-{tag}", k8s_dataset_path=f"/data/{dataset.name}",
            k8s_mlflow_tracking_uri=mlflow["pod_uri"], k8s_rdzv_port=free_port(), k8s_termination_grace_s=15,
            k8s_rdzv_timeout_s=60, steps=200, batch_size=64, lr=3e-3, checkpoint_every=50, log_every=10)
        self.params.update(overrides)
        self.root, self.s3 = root, s3
        self.dag = load_dag("distributed_training")
        self.cluster = Cluster(engine, root / "cluster", namespace=NAMESPACE,
                               extra_hosts={"mlflow.pods.test": "127.0.0.1"})
        self.cluster.add_secret(self.params["k8s_s3_secret"], {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_ENDPOINT_URL": s3["endpoint"], "AWS_DEFAULT_REGION": "us-east-1"})
        self.checkpoints = root / "pvc-checkpoints"
        self.cluster.add_claim(self.params["k8s_checkpoint_pvc"], self.checkpoints)
        self.cluster.add_claim(self.params["k8s_data_pvc"], dataset.parent)
        boto3.client("s3", endpoint_url=s3["endpoint"]).create_bucket(Bucket="pods")
        self.opened: dict | None = None

    def context(self, task_id: str) -> dict:
        """What Airflow hands the task: its Params and task instance (first try)."""
        ti = SimpleNamespace(try_number=1, dag_id="distributed_training", task_id=task_id, map_index=-1)
        return {"params": self.params, "ti": ti, "run_id": f"pods-{self.root.name}", "dag": self.dag}

    def validate(self) -> dict:
        from training_airflow import tasks

        self.opened = tasks.validate_data(self.params, dag_id="distributed_training", dag_run_id=f"pods-{self.root.name}")
        return self.opened

    def _op(self, task_id: str) -> tuple[Any, dict]:
        """The DAG's operator with its run-time arguments set, and its task context."""
        op = self.dag.task_dict[task_id]
        op.handoff = self.opened  # what templating makes of the validate_data XComArg
        context = self.context(task_id)
        op.prepare(context)
        return op, context

    def render(self) -> tuple[dict, dict]:
        """The Service and the Job, from the DAG's operators."""
        svc, _ = self._op("create_rendezvous_service")
        job_op, context = self._op("train_on_kubernetes")
        job = ApiClient().sanitize_for_serialization(job_op.build_job_request_obj(context))
        return yaml.safe_load(svc.yaml_conf), job

    def upload(self, timeout_s: float = 180) -> Any:
        op, context = self._op("upload_on_kubernetes")
        pod = standalone_pod(self.cluster, ApiClient().sanitize_for_serialization(op.build_pod_request_obj(context)))
        deadline = time.monotonic() + timeout_s
        while pod.phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            pod.step()
            time.sleep(0.5)
        return pod

    def run_dir(self) -> Path:
        return self.checkpoints / self.params["experiment"] / self.opened["mlflow_run_id"]


@pytest.fixture
def pods_run(container_engine, training_image, tmp_path, dataset, s3_server, mlflow_server, monkeypatch):
    runs = []

    def make(**overrides) -> PodsRun:
        run = PodsRun(engine=container_engine, image=training_image, root=tmp_path, dataset=dataset, s3=s3_server,
                      mlflow=mlflow_server, monkeypatch=monkeypatch, **overrides)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.cluster.cleanup()


def _final_manifest_matches(s3_endpoint: str, checkpoint_uri: str) -> dict:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket, prefix = checkpoint_uri.removeprefix("s3://").split("/", 1)
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read())
    for f in manifest["files"]:
        body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{f['path']}")["Body"].read()
        assert (len(body), hashlib.sha256(body).hexdigest()) == (f["size"], f["sha256"]), f["path"]
    return manifest


@pytest.mark.slow
def test_two_pods_rendezvous_train_commit_and_evaluate(pods_run):
    from training_airflow import tasks
    from training_airflow.backends.kubernetes.operators import confirm_commit

    run = pods_run()
    opened = run.validate()
    service, job = run.render()
    spec = job["spec"]["template"]["spec"]
    # The headless Service selects the Job's pods, and its name is their subdomain.
    assert service["spec"]["clusterIP"] == "None" and spec["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()

    played = PlayedJob(run.cluster, job)
    played.run(timeout_s=600)
    assert played.condition[0] == "Complete", played.describe()
    assert played.history == [], "no pod failed"
    pod0 = next(p for p in played.pods.values() if p.index == 0)
    log0 = pod0.logs()
    assert "train: mlp/ddp/fp32 on 2 ranks, backend=gloo" in log0, log0[-3000:]
    assert f"train: done at step {run.params['steps']}" in log0

    upload = run.upload()
    assert upload.phase == "Succeeded", upload.logs()[-3000:]

    handoff = confirm_commit(run.params, opened, job=played.status())
    assert handoff["final_step"] == run.params["steps"] and handoff["torchrun_wall_s"] > 0
    manifest = _final_manifest_matches(run.s3["endpoint"], handoff["checkpoint_uri"])
    assert manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", "COMPLETE", "model.safetensors"} <= {f["path"] for f in manifest["files"]}

    scored = tasks.evaluate(run.params, handoff)
    assert 0.6 <= scored["eval_accuracy"] <= 1.0

    client = MlflowClient()
    mlrun = client.get_run(opened["mlflow_run_id"])
    assert SCHEMA <= set(mlrun.data.metrics), sorted(SCHEMA - set(mlrun.data.metrics))
    assert (mlrun.data.params["world_size"], mlrun.data.params["backend"]) == ("2", "gloo")
    loss = client.get_metric_history(opened["mlflow_run_id"], "train/loss")
    assert [h.step for h in loss] == list(range(10, run.params["steps"] + 1, 10)), "one point per log interval"
