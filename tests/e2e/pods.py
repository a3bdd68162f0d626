"""Kubernetes without a cluster, for tests/e2e/test_pods.py: what the control plane does is played
here, faithfully and no further; what runs in the pods is real.

No API server can run on these machines (docs/operations.md). Played, each as Kubernetes does it:

- **the Job controller** (batch/v1 Job, ``completionMode: Indexed``): one pod per index up to
  ``parallelism``, named ``<job>-<index>-<suffix>``, with the label and annotation
  ``batch.kubernetes.io/job-completion-index``, the ``job-name`` label, ``JOB_COMPLETION_INDEX`` in
  every container's environment (the controller injects it through the downward API; here as a
  value) and ``hostname: <job>-<index>``. A failed pod is matched against the Job's own
  ``podFailurePolicy`` rules, in order (FailJob, Ignore, Count), as rendered; counted failures
  go against ``backoffLimit``; a failed index gets a replacement pod (at once: the controller's
  back-off delay of 10 s, doubling, is left out). The Job completes when its ``successPolicy``
  is met or every index succeeded; then the pods still running are stopped.
- **the scheduler**: one node with the labels a kubelet registers; a pod whose ``nodeSelector``
  the node lacks stays Pending with ``PodScheduled=False``, reason Unschedulable, and the
  scheduler's message. After a node is lost (``lose_node``), the replacement of its pod finds no
  room and stays Pending the same way.
- **the kubelet**: init containers first, each to completion, in order (each its own
  ``podman kube play``: kube play's own wait for init containers takes 20 s here), then the pod
  with ``podman kube play --network host``; an image it cannot pull leaves the pod waiting
  (ErrImagePull, then ImagePullBackOff) and is tried again; the pod's ``/etc/hosts`` is the
  file the kubelet writes (``<pod IP> <FQDN> <hostname>``, mounted like the kubelet's); a
  container's termination message is the last line of its log (FallbackToLogsOnError).
- **the pod network and the headless Service's DNS**: every pod shares the host's network
  namespace and gets its own loopback address (127.0.0.2 + index), and the names the Service
  gives (``<hostname>.<subdomain>.<namespace>.svc.<domain>``) are in every pod's hosts file;
  ``extra_hosts`` adds names of servers outside the cluster (MLflow) on 127.0.0.1.
- **volumes**: a PersistentVolumeClaim is a podman volume bound to a host folder; an emptyDir
  is a volume of its pod (podman would share one by name across pods); Secrets are podman secrets.

Real: the image; every pod's containers, command lines, environment, security context and
resource limits exactly as the DAG's operators rendered them; torchrun's c10d rendezvous; gloo
between the pods; MLflow and S3 (moto) over HTTP.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

INDEX = "batch.kubernetes.io/job-completion-index"
UNSCHEDULABLE = ("0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. preemption: 0/1 nodes "
                 "are available: 1 Preemption is not helpful for scheduling.")
NO_ROOM = "0/1 nodes are available: 1 node(s) were unschedulable (the node of this index was lost)."


def _now() -> datetime:
    return datetime.now(timezone.utc)


def pod_address(index: int) -> str:
    return f"127.0.0.{2 + index}"


class Cluster:
    """One node (this machine), its volumes and secrets, and the pods started on it."""

    def __init__(self, engine: Any, root: Path, *, namespace: str, domain: str = "cluster.local",
                 extra_hosts: dict[str, str] | None = None) -> None:
        self.engine, self.root, self.namespace, self.domain = engine, root, namespace, domain
        self.extra_hosts = extra_hosts or {}
        self.node_labels = {"kubernetes.io/hostname": socket.gethostname(), "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64"}
        self.lost_nodes: set[int] = set()  # indexes whose node is gone: their replacements stay Pending
        self.pods: list[PlayedPod] = []
        self.volumes: list[str] = []
        self.secrets: list[str] = []
        root.mkdir(parents=True, exist_ok=True)

    def add_secret(self, name: str, data: dict[str, str]) -> None:
        """A Secret as podman 4.3's kube play reads it: a JSON map of base64 values."""
        payload = json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in data.items()})
        self.engine("secret", "create", name, "-", input=payload)
        self.secrets.append(name)

    def add_claim(self, name: str, folder: Path) -> None:
        """A PersistentVolumeClaim bound to a host folder (writable by the pods' non-root user:
        fsGroup, which a kubelet applies to the volume, is not applied by podman)."""
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)
        self.engine("volume", "create", "--opt", "type=none", "--opt", "o=bind", "--opt", f"device={folder}", name)
        self.volumes.append(name)

    def hosts_file(self, hostnames: dict[int, str], subdomain: str | None, index: int | None) -> Path:
        """The /etc/hosts a kubelet writes, plus the Service's DNS names of every pod."""
        lines = ["127.0.0.1\tlocalhost"]
        for i, host in sorted(hostnames.items()):
            fqdn = f"{host}.{subdomain}.{self.namespace}.svc.{self.domain}" if subdomain else host
            lines.append(f"{pod_address(i)}\t{fqdn}\t{host}")
        lines += [f"{ip}\t{name}" for name, ip in self.extra_hosts.items()]
        path = self.root / f"hosts-{secrets.token_hex(4)}-{index}"
        path.write_text("\n".join(lines) + "\n")
        return path

    def schedulable(self, pod: dict[str, Any], index: int | None) -> str | None:
        """None if the node can take the pod, else the scheduler's message."""
        wanted = pod["spec"].get("nodeSelector") or {}
        if any(self.node_labels.get(k) != v for k, v in wanted.items()):
            return UNSCHEDULABLE
        if index is not None and index in self.lost_nodes:
            return NO_ROOM
        return None

    def cleanup(self) -> None:
        for pod in self.pods:
            pod.remove()
        for name in self.volumes:
            self.engine("volume", "rm", "-f", name, check=False, timeout=120)
        for name in self.secrets:
            self.engine("secret", "rm", name, check=False, timeout=120)


@dataclass
class PlayedPod:
    """One pod: scheduled, its init containers run, then the pod itself under podman."""

    cluster: Cluster
    manifest: dict[str, Any]
    index: int | None = None
    hosts: Path | None = None
    phase: str = "Pending"
    created: datetime = field(default_factory=_now)
    started: datetime | None = None
    unschedulable: str | None = None
    waiting: tuple[str, str] | None = None  # (reason, message) of a container the kubelet cannot start
    exit_codes: dict[str, int] = field(default_factory=dict)  # container -> exit code
    messages: dict[str, str] = field(default_factory=dict)  # container -> termination message
    played: list[str] = field(default_factory=list)  # podman pods made for it
    _next_try: float = 0.0
    _pulls: int = 0
    _init: tuple[int, str] | None = None  # (index, podman container) of the init container running

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    def container_name(self, container: str = "base") -> str:
        return f"{self.name}-{container}"

    def _podman_pod(self, containers: list[dict], *, suffix: str = "") -> dict[str, Any]:
        """The manifest podman plays: the pod's containers (or one init container), each pod's
        emptyDirs its own, and the kubelet's hosts file mounted at /etc/hosts."""
        m = copy.deepcopy(self.manifest)
        m["metadata"]["name"] = self.name + suffix
        spec = m["spec"]
        spec.pop("initContainers", None)
        spec["containers"] = copy.deepcopy(containers)
        own = {v["name"]: f"{self.name}-{v['name']}" for v in spec.get("volumes", []) if "emptyDir" in v}
        for v in spec.get("volumes", []):
            v["name"] = own.get(v["name"], v["name"])
        spec.setdefault("volumes", []).append({"name": f"{self.name}-hosts", "hostPath": {"path": str(self.hosts),
                                                                                          "type": "File"}})
        # The kubelet's downward API for what podman's kube play does not fill: the pod's address
        # (pod_address, as in the hosts file) and the node's name.
        downward = {"status.podIP": pod_address(self.index) if self.index is not None else "127.0.0.1",
                    "spec.nodeName": socket.gethostname()}
        for c in spec["containers"]:
            # A container port only names a port in Kubernetes (the Job declares the metrics ports for
            # scraping); podman would map it, which its host network refuses.
            c.pop("ports", None)
            for env in c.get("env") or []:
                path = ((env.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
                if path in downward:
                    env.pop("valueFrom")
                    env["value"] = downward[path]
            for mount in c.get("volumeMounts", []):
                mount["name"] = own.get(mount["name"], mount["name"])
            c.setdefault("volumeMounts", []).append({"name": f"{self.name}-hosts", "mountPath": "/etc/hosts",
                                                     "readOnly": True})
        return m

    def _play(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess:
        path = self.cluster.root / f"{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        self.played.append(manifest["metadata"]["name"])
        return self.cluster.engine("kube", "play", "--network", "host", str(path), check=False, timeout=300)

    def _state(self, container: str) -> tuple[str, int]:
        out = self.cluster.engine("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container,
                                  check=False)
        status, code = (out.stdout.split() + ["missing", "0"])[:2] if out.returncode == 0 else ("missing", "0")
        return status, int(code)

    def logs(self, container: str = "base") -> str:
        name = container if container.startswith(self.name) else self.container_name(container)
        out = self.cluster.engine("logs", name, check=False)
        return out.stdout + out.stderr

    def _ended(self, container: str, podman_name: str, code: int) -> None:
        self.exit_codes[container] = code
        last = self.logs(podman_name).strip().splitlines()
        self.messages[container] = last[-1] if last else ""

    def step(self) -> None:
        """What the scheduler and the kubelet do for this pod now (never blocks)."""
        if self.phase in ("Succeeded", "Failed"):
            return
        if self.started is None:
            self._start()
            return
        status, code = self._state(self.container_name())
        if status in ("exited", "stopped"):
            self._ended("base", self.container_name(), code)
            self.phase = "Succeeded" if code == 0 else "Failed"

    def _start(self) -> None:
        """Schedule, then each init container to completion in order, then the pod's containers."""
        inits = self.manifest["spec"].get("initContainers") or []
        if self._init is not None:  # an init container is running
            k, name = self._init
            status, code = self._state(name)
            if status not in ("exited", "stopped", "missing"):
                return
            self._ended(inits[k]["name"], name, code)
            self._init = None
            if code != 0:  # restartPolicy Never: a failed init container fails the pod
                self.phase = "Failed"
                return
        else:
            self.unschedulable = self.cluster.schedulable(self.manifest, self.index)
            if self.unschedulable or time.monotonic() < self._next_try:
                return
        done = sum(1 for c in inits if c["name"] in self.exit_codes)
        if done < len(inits):
            out = self._play(self._podman_pod([inits[done]], suffix=f"-init{done}"))
            if out.returncode != 0:
                self._pull_failed(out.stderr)
            else:
                self._init = (done, f"{self.name}-init{done}-{inits[done]['name']}")
            return
        out = self._play(self._podman_pod(self.manifest["spec"]["containers"]))
        if out.returncode != 0:
            self._pull_failed(out.stderr)
            return
        self.started, self.waiting, self.phase = _now(), None, "Running"

    def _pull_failed(self, stderr: str) -> None:
        """The kubelet's image pull back-off: ErrImagePull, then ImagePullBackOff, tried again."""
        error = next((line for line in reversed(stderr.strip().splitlines()) if line.startswith("Error:")), stderr)
        if not re.search(r"pull|image|registry|manifest", error, re.I):
            raise RuntimeError(f"podman kube play refused pod {self.name}: {stderr[-2000:]}")
        self._pulls += 1
        self.waiting = ("ErrImagePull" if self._pulls == 1 else "ImagePullBackOff", error.removeprefix("Error: "))
        for name in self.played:
            self.cluster.engine("pod", "rm", "-f", name, check=False)
        self.played.clear()
        self._next_try = time.monotonic() + min(2.0 * self._pulls, 10.0)

    def signal(self, sig: str) -> None:
        """A signal to the pod's main container (SIGKILL: the container dies, as with a lost node)."""
        self.cluster.engine("kill", "--signal", sig, self.container_name())

    def stop(self, grace_s: int) -> subprocess.CompletedProcess:
        """What the kubelet does to a pod being terminated: SIGTERM, then SIGKILL after the grace."""
        return self.cluster.engine("stop", "--time", str(grace_s), self.container_name(), timeout=grace_s + 60)

    def remove(self) -> None:
        # Checked and retried: once, under heavy load, `pod rm -f` left a pod whose container had
        # exited ("Degraded"), and podman 4.3's `volume rm -f` of a volume that pod still used then
        # hung on its own lock for good (cleanup removes the volumes next).
        for name in self.played:
            for attempt in range(3):
                self.cluster.engine("pod", "rm", "-f", "--time", "0", name, check=False, timeout=120)
                if self.cluster.engine("pod", "exists", name, check=False, timeout=60).returncode != 0:
                    break
                time.sleep(1 + attempt)
        self.played.clear()

    def v1pod(self) -> Any:
        """The pod's status as the API server would report it (kubernetes client objects)."""
        from kubernetes.client import models as k8s

        conditions = []
        if self.unschedulable:
            conditions.append(k8s.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                                                 message=self.unschedulable, last_transition_time=self.created))

        def status(c: dict[str, Any]) -> Any:
            state = k8s.V1ContainerState()
            if c["name"] in self.exit_codes:
                code = self.exit_codes[c["name"]]
                state.terminated = k8s.V1ContainerStateTerminated(exit_code=code, message=self.messages[c["name"]],
                                                                  reason="Completed" if code == 0 else "Error")
            elif self.waiting:
                state.waiting = k8s.V1ContainerStateWaiting(reason=self.waiting[0], message=self.waiting[1])
            return k8s.V1ContainerStatus(name=c["name"], image=c["image"], image_id="", ready=False, restart_count=0,
                                         state=state)

        spec = self.manifest["spec"]
        return k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name=self.name, labels=self.manifest["metadata"].get("labels")),
            spec=k8s.V1PodSpec(containers=[], node_selector=spec.get("nodeSelector")),
            status=k8s.V1PodStatus(phase=self.phase, conditions=conditions,
                                   start_time=None if self.unschedulable else self.created,
                                   init_container_statuses=[status(c) for c in spec.get("initContainers") or []],
                                   container_statuses=[status(c) for c in spec["containers"]]))


def standalone_pod(cluster: Cluster, pod: dict[str, Any]) -> PlayedPod:
    """A pod created directly (the upload pod), with the kubelet's hosts file."""
    p = PlayedPod(cluster, copy.deepcopy(pod))
    p.hosts = cluster.hosts_file({}, None, None)
    cluster.pods.append(p)
    return p


class PlayedJob:
    """The Job controller for one Indexed Job, driven by ``step()`` (one reconcile) or ``run()``."""

    def __init__(self, cluster: Cluster, job: dict[str, Any]) -> None:
        self.cluster, self.job = cluster, job
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["restartPolicy"] == "Never"
        self.name = job["metadata"]["name"]
        self.n = int(spec["completions"])
        self.backoff_limit = int(spec.get("backoffLimit", 6))
        self.rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
        self.success_indexes = {int(r["succeededIndexes"]) for r in (spec.get("successPolicy") or {}).get("rules", [])}
        self.failed = 0  # pods counted against backoffLimit
        self.pods: dict[int, PlayedPod] = {}
        self.history: list[tuple[int, str, int | None, str]] = []  # (index, pod, exit code, action)
        self.condition: tuple[str, str] | None = None  # ("Complete" | "Failed", reason)
        self.start_time = _now()
        self.completion_time: datetime | None = None
        subdomain = spec["template"]["spec"].get("subdomain")
        hostnames = {i: f"{self.name}-{i}" for i in range(self.n)}
        self.hosts = {i: cluster.hosts_file(hostnames, subdomain, i) for i in range(self.n)}
        for i in range(int(spec["parallelism"])):
            self._create(i)

    def _create(self, index: int) -> None:
        tmpl = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(self.job["spec"]["template"])}
        meta, spec = tmpl["metadata"], tmpl["spec"]
        meta["name"] = f"{self.name}-{index}-{secrets.token_hex(3)[:5]}"
        meta["namespace"] = self.job["metadata"]["namespace"]
        meta["labels"] = {**(meta.get("labels") or {}), "job-name": self.name, "batch.kubernetes.io/job-name": self.name,
                          INDEX: str(index)}
        meta["annotations"] = {**(meta.get("annotations") or {}), INDEX: str(index)}
        spec["hostname"] = f"{self.name}-{index}"
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            c["env"] = [*(c.get("env") or []), {"name": "JOB_COMPLETION_INDEX", "value": str(index)}]
        pod = PlayedPod(self.cluster, tmpl, index=index, hosts=self.hosts[index])
        self.pods[index] = pod
        self.cluster.pods.append(pod)

    def _policy(self, pod: PlayedPod) -> str:
        """The action of the first podFailurePolicy rule the failed pod matches, else Count."""
        for rule in self.rules:
            req = rule.get("onExitCodes")
            if req:
                codes = [code for c, code in pod.exit_codes.items() if code and req.get("containerName") in (None, c)]
                hit = [code for code in codes if (code in req["values"]) == (req["operator"] == "In")]
                if hit:
                    return rule["action"]
            # onPodConditions (DisruptionTarget) needs an eviction or a preemption by the API: none here.
        return "Count"

    def step(self) -> None:
        if self.condition:
            return
        for index, pod in list(self.pods.items()):
            pod.step()
            if pod.phase != "Failed":
                continue
            action = self._policy(pod)
            self.history.append((index, pod.name, pod.exit_codes.get("base"), action))
            if action == "FailJob":
                return self._finish("Failed", "PodFailurePolicy")
            if action == "Count":
                self.failed += 1
                if self.failed > self.backoff_limit:
                    return self._finish("Failed", "BackoffLimitExceeded")
            self._create(index)  # Ignore or Count: a replacement for the index
        done = {i for i, p in self.pods.items() if p.phase == "Succeeded"}
        if (self.success_indexes and self.success_indexes <= done) or len(done) == self.n:
            self._finish("Complete", "SuccessPolicy" if len(done) < self.n else "Completed")

    def _finish(self, kind: str, reason: str) -> None:
        self.condition = (kind, reason)
        self.completion_time = _now()
        for pod in self.pods.values():  # the controller terminates what still runs
            if pod.phase in ("Pending", "Running"):
                pod.remove()

    def run(self, timeout_s: float, *, until: Any = None, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.condition and time.monotonic() < deadline:
            self.step()
            if until is not None and until(self):
                return
            time.sleep(poll_s)
        if not self.condition and until is None:
            raise TimeoutError(f"Job {self.name} still running after {timeout_s}s: {self.describe()}")

    def v1pods(self) -> list[Any]:
        """Every pod of the Job, replaced ones included (what `kubectl get pods -l job-name=...` lists)."""
        return [p.v1pod() for p in self.cluster.pods if (p.manifest["metadata"].get("labels") or {}).get("job-name")
                == self.name]

    def status(self) -> dict[str, Any]:
        """The Job as the provider's operator pushes it to XCom (``job.to_dict()``)."""
        return {"metadata": {"name": self.name}, "status": {
            "start_time": self.start_time, "completion_time": self.completion_time,
            "conditions": [{"type": self.condition[0], "reason": self.condition[1], "status": "True"}]
            if self.condition else []}}

    def describe(self) -> str:
        return "; ".join(f"{p.name}: {p.phase} {p.exit_codes or ''} {p.waiting or ''} {p.unschedulable or ''}"
                         for p in self.pods.values())


def run_to_end(engine: Any, args: list[str], *, timeout_s: float = 300) -> tuple[int, str]:
    """``<engine> run -d ARGS``, waited for by polling its state (an attached run waits 20 s
    after the container ended on these hosts), then its log; the container is removed."""
    name = f"t-{secrets.token_hex(4)}"
    engine("run", "-d", "--name", name, *args)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = engine("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name)
            status, code = out.stdout.split()
            if status in ("exited", "stopped"):
                logs = engine("logs", name, check=False)
                return int(code), logs.stdout + logs.stderr
            time.sleep(0.3)
        raise TimeoutError(f"container {name} still running after {timeout_s}s: {engine('logs', name).stdout[-2000:]}")
    finally:
        engine("rm", "-f", "--time", "0", name, check=False)


# --------------------------------------------------------------------------- one DAG run on the played cluster

NAMESPACE = "training"
MLFLOW_POD_HOST = "mlflow.pods.test"  # the MLflow server's name as the pods see it (their hosts file: 127.0.0.1)


def kubeconfig(root: Path) -> Path:
    """The cluster connection the operators need to build their objects; nothing is ever sent."""
    path = root / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\n"
                    "clusters: [{name: none, cluster: {server: 'https://127.0.0.1:1'}}]\n"
                    "users: [{name: none, user: {token: not-a-token}}]\n"
                    "contexts: [{name: none, context: {cluster: none, user: none}}]\ncurrent-context: none\n")
    return path


def start_mlflow_server(root: Path) -> tuple[dict[str, str], subprocess.Popen]:
    """A real MLflow tracking server on 127.0.0.1 (SQLite store, artifacts served by the server)
    that also answers to MLFLOW_POD_HOST; returns its addresses and process."""
    import os
    import sys

    from tests.conftest import wait_for_port
    from training.util import free_port

    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
         str(root / "artifacts"), "--allowed-hosts", f"127.0.0.1:{port},{MLFLOW_POD_HOST}:{port}"],
        stdout=(root / "server.log").open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    wait_for_port(port, timeout=120)
    return {"worker_uri": f"http://127.0.0.1:{port}", "pod_uri": f"http://{MLFLOW_POD_HOST}:{port}"}, proc


class PodsRun:
    """One DAG run of the kubernetes backend: its Params, the worker-side task bodies, the Service,
    Job and upload pod rendered by the DAG's operators, and the played cluster they run on.
    ``setenv`` sets the worker's environment (pytest's monkeypatch.setenv in a test)."""

    def __init__(self, *, engine: Any, image: str, root: Path, dataset: Path, s3_endpoint: str,
                 mlflow: dict[str, str], setenv: Any, **overrides: Any) -> None:
        import boto3
        import mlflow as mlflow_module

        from tests.conftest import load_dag
        from training.util import free_port
        from training_airflow.params import training_params

        root.mkdir(parents=True, exist_ok=True)
        tag = secrets.token_hex(4)  # names of this run's volumes and Secret on the machine
        setenv("TRAINING_BACKENDS", "local,kubernetes")
        setenv("MLFLOW_TRACKING_URI", mlflow["worker_uri"])
        setenv("AIRFLOW_CONN_KUBE_PODS_TEST", json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig(root))}}))
        mlflow_module.set_tracking_uri(mlflow["worker_uri"])
        self.params = {name: p.value for name, p in training_params(["local", "kubernetes"]).items()}
        self.params.update(
            backend="kubernetes", experiment="pods", dataset_uri=str(dataset), store_uri="s3://pods/team",
            kubernetes_conn_id="kube_pods_test", k8s_namespace=NAMESPACE, k8s_image=image, k8s_nnodes=2,
            k8s_gpus_per_node=0, k8s_cpu_request="500m", k8s_cpu_limit="1", k8s_memory_request="1Gi",
            k8s_memory_limit="3Gi", k8s_shm_size="256Mi", k8s_checkpoint_pvc=f"ckpt-{tag}", k8s_data_pvc=f"data-{tag}",
            k8s_s3_secret=f"s3-{tag}", k8s_dataset_path=f"/data/{dataset.name}", k8s_mlflow_tracking_uri=mlflow["pod_uri"],
            k8s_rdzv_port=free_port(), k8s_termination_grace_s=15, k8s_rdzv_timeout_s=60,
            steps=120, batch_size=64, lr=3e-3, checkpoint_every=40, log_every=10)
        self.params.update(overrides)
        self.root, self.s3_endpoint = root, s3_endpoint
        self.dag_run_id = f"pods-{tag}"
        self.dag = load_dag("distributed_training")
        self.cluster = Cluster(engine, root / "cluster", namespace=NAMESPACE, extra_hosts={MLFLOW_POD_HOST: "127.0.0.1"})
        self.cluster.add_secret(self.params["k8s_s3_secret"], {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1"})
        self.checkpoints = root / "pvc-checkpoints"
        self.cluster.add_claim(self.params["k8s_checkpoint_pvc"], self.checkpoints)
        self.cluster.add_claim(self.params["k8s_data_pvc"], dataset.parent)
        boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="pods")
        self.opened: dict | None = None

    def context(self, task_id: str) -> dict:
        """What Airflow hands the task: its Params, its task instance (first try), the DAG."""
        from types import SimpleNamespace

        ti = SimpleNamespace(try_number=1, dag_id="distributed_training", task_id=task_id, map_index=-1)
        return {"params": self.params, "ti": ti, "run_id": self.dag_run_id, "dag": self.dag}

    def validate(self) -> dict:
        """The ``open_run`` and ``validate_data`` tasks: the backend's checks, the MLflow run, the data gate."""
        from training_airflow import tasks

        opened = tasks.open_run(self.params, dag_id="distributed_training", dag_run_id=self.dag_run_id)
        self.opened = tasks.validate_data(self.params, opened)
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
        from kubernetes.client import ApiClient

        svc, _ = self._op("create_rendezvous_service")
        job_op, context = self._op("train_on_kubernetes")
        job = ApiClient().sanitize_for_serialization(job_op.build_job_request_obj(context))
        return yaml.safe_load(svc.yaml_conf), job

    @staticmethod
    def slow_steps(job: dict, delay_ms: int) -> None:
        """A drill knob in the training container's environment: every gradient all-reduce
        completes ``delay_ms`` later (TRAINING_FAULT_COMM_DELAY_MS; it changes no number), so a
        signal sent after step N lands mid-run however fast or loaded the machine is."""
        base = job["spec"]["template"]["spec"]["containers"][0]
        base["env"].append({"name": "TRAINING_FAULT_COMM_DELAY_MS", "value": str(delay_ms)})

    def upload(self, timeout_s: float = 180) -> PlayedPod:
        """The upload pod, rendered by its operator, run to its end."""
        from kubernetes.client import ApiClient

        op, context = self._op("upload_on_kubernetes")
        pod = standalone_pod(self.cluster, ApiClient().sanitize_for_serialization(op.build_pod_request_obj(context)))
        deadline = time.monotonic() + timeout_s
        while pod.phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            pod.step()
            time.sleep(0.5)
        return pod

    def run_dir(self) -> Path:
        """This run's folder on the checkpoint volume (checkpoints/, output/steps.jsonl)."""
        return self.checkpoints / self.params["experiment"] / self.opened["mlflow_run_id"]

    def steps(self) -> list[dict]:
        """Rank 0's per-step records (StepLog, training/metrics/steps.py), every attempt."""
        from training.train import StepLog

        return StepLog.read(self.run_dir() / "output")

    def wait_for_step(self, played: PlayedJob, step: int, timeout_s: float = 300) -> None:
        played.run(timeout_s, until=lambda job: (self.steps() or [{"step": 0}])[-1]["step"] >= step)
        if played.condition:
            raise AssertionError(f"the Job ended before step {step}: {played.describe()}")
