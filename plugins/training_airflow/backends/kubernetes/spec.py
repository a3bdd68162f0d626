"""Pure spec building of the Kubernetes backend: names, the Service, the Indexed Job and the
upload pod as the cncf-kubernetes provider's operators take them. Params in, operator arguments
out: no cluster, no Airflow context, so tests build the real objects through the real operators.
One module past 400 lines because the three objects of a run share its ``Names``, image, security
settings, volumes and S3 environment, and change together.

A headless Service gives pod ``i`` of the Job (``completions = parallelism = k8s_nnodes``) the name
``<job name>-<i>.<service>.<namespace>.svc.<cluster domain>``; every pod runs ``LAUNCHER`` with the
c10d rendezvous on pod 0's name. ``checkpoint_location=store`` (default): the ranks commit to the
``s3://`` store, no volume, no upload pod; ``local``: checkpoints on the ReadWriteMany PVC
``k8s_checkpoint_pvc`` at ``/checkpoints``, the final one committed by the upload pod.
docs/architecture.md ("Kubernetes backend") explains the objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml
from kubernetes.client import models as k8s

from airflow.providers.cncf.kubernetes.operators.job import JOB_NAME_PREFIX
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from training.distributed.elastic import EXIT_BAD_INPUT, EXIT_PREEMPTED
from training_airflow import policy

CHECKPOINT_MOUNT = "/checkpoints"
DATA_MOUNT = "/data"
APP_LABEL = "app.kubernetes.io/name"
APP = "distributed-training"
COMPONENT_LABEL = "app.kubernetes.io/component"
RDZV_LABEL = "distributed-training/rendezvous"
BASE_CONTAINER = KubernetesPodOperator.BASE_CONTAINER_NAME  # "base": the provider names the main container
CHECK_CONTAINER = "check-config"
RUN_UID = 10001  # the non-root user of docker/training.Dockerfile
# The exit-code contract of `python -m training` (training/cli.py), carried to the pod's status by
# the launcher (training/distributed/elastic.py: torchrun itself reports every failed rank as 1):
# 2 bad input: the FailJob rule fails the Job at once. The trainer's own parser (`train
#   --print-config`) first runs in an init container, so a bad config never starts torchrun;
#   torchrun exits 2 on bad command-line arguments, which the same rule covers.
# 75 preempted: the ranks wrote a checkpoint of the current step. The Ignore rule replaces the pod
#   without counting it against backoffLimit, and the replacement resumes from that checkpoint.
# What the training container runs: torchrun's agent with the exit-code contract (training/distributed/elastic.py).
LAUNCHER = ["python", "-m", "training.distributed.elastic"]
# Seconds each layer of a preempted pod keeps back from the one above it: the agent stops waiting
# for its ranks this long before the kubelet's SIGKILL, and the ranks give up this long before the
# agent's own SIGKILL, so a stuck rank is reported by the layer that waited for it.
GRACE_MARGIN_S = 5
# c10d rendezvous settings that decide how fast a run recovers from a lost pod
# (benchmarks/recovery_bench.py, docs/benchmarks.md "Elastic scale-down recovery"):
# - after the minimum of nodes joined, wait this long for more (torch's default: 30 s);
# - each agent writes a keep-alive to the store every RDZV_KEEP_ALIVE_S; a node that missed
#   RDZV_KEEP_ALIVE_MISSES in a row is dead, and only then can the survivors start a new round
#   without it (torch's default: 5 s x 3).
RDZV_LAST_CALL_S = 5
RDZV_KEEP_ALIVE_S = 1
RDZV_KEEP_ALIVE_MISSES = 3
MAX_DNS_LABEL = 63
S3_ENV = {  # variable (= key in the Secret) -> optional
    "AWS_ACCESS_KEY_ID": False,
    "AWS_SECRET_ACCESS_KEY": False,
    "AWS_ENDPOINT_URL": True,
    "AWS_DEFAULT_REGION": True,
}
# Operator arguments that are the same for every run (set when the DAG is parsed).
JOB_STATIC_KWARGS = {"wait_until_job_complete": True, "job_poll_interval": 15, "get_logs": True,
                     "deferrable": False, "on_finish_action": "delete_succeeded_pod", "random_name_suffix": False}
POD_STATIC_KWARGS = {"get_logs": True, "deferrable": False, "on_finish_action": "delete_succeeded_pod",
                     "startup_timeout_seconds": 900}

# --------------------------------------------------------------------------- names


@dataclass(frozen=True)
class Names:
    """Every name of one run on the cluster, derived from its MLflow run id (and the task try)."""

    namespace: str
    service: str  # headless Service = pod subdomain
    job_base: str  # what we pass to the Job operator (random suffix off)
    job: str  # what the provider renders: JOB_NAME_PREFIX + job_base
    rdzv_host: str  # pod 0's stable DNS name
    rdzv_port: int
    upload_pod: str
    run_dir: str  # this run's folder on the checkpoint volume

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.rdzv_host}:{self.rdzv_port}"

    def pod_hostname(self, index: int) -> str:
        return f"{self.job}-{index}"


def names(params: dict[str, Any], *, mlflow_run_id: str, try_number: int) -> Names:
    # MLflow run ids are 32 hex digits; 16 of them keep names short and still unique per run.
    key = re.sub(r"[^a-z0-9]", "", mlflow_run_id.lower())[:16]
    if not key:
        raise ValueError(f"MLflow run id {mlflow_run_id!r} gives no name for Kubernetes objects")
    ns = params["k8s_namespace"]
    service = f"rdzv-{key}"
    # A new Job per task try: the failed Job of the last try may still exist (ttlSecondsAfterFinished).
    job_base = f"train-{key}-{int(try_number)}"
    job = f"{JOB_NAME_PREFIX}{job_base}"
    # The pod's FQDN exactly as the kubelet writes it into the pod's /etc/hosts: torchrun's c10d
    # backend decides which agent hosts the store by comparing the endpoint with the canonical
    # name of its own hostname, so pod 0 recognises itself without waiting for DNS.
    host = f"{job}-0.{service}.{ns}.svc.{params['k8s_cluster_domain']}"
    return Names(namespace=ns, service=service, job_base=job_base, job=job, rdzv_host=host,
                 rdzv_port=int(params["k8s_rdzv_port"]), upload_pod=f"upload-{key}",
                 run_dir=f"{CHECKPOINT_MOUNT}/{params['experiment']}/{mlflow_run_id}")




def node_range(params: dict[str, Any]) -> tuple[int, int]:
    nmax = int(params["k8s_nnodes"])
    nmin = int(params["k8s_min_nodes"]) or nmax
    return nmin, nmax


def procs_per_node(params: dict[str, Any]) -> int:
    """torchrun --nproc-per-node: one rank per GPU, or one rank per pod on CPU pods."""
    return max(1, int(params["k8s_gpus_per_node"]))


def world_sizes(params: dict[str, Any]) -> list[int]:
    """Every world size the run may have: torchrun can go on with any node count in [min, max]."""
    nmin, nmax = node_range(params)
    return [n * procs_per_node(params) for n in range(nmin, nmax + 1)]


@dataclass(frozen=True)
class Grace:
    """The preemption window of a training pod, each layer derived from ``k8s_termination_grace_s``."""

    pod_s: int  # terminationGracePeriodSeconds: SIGTERM to the agent, SIGKILL this much later
    agent_s: int  # torchrun --shutdown-timeout: the agent waits this long for its ranks, then SIGKILLs them
    rank_s: int  # the trainer's preempt_grace_s: a rank exits (143) this long after SIGTERM at the latest


def grace(params: dict[str, Any]) -> Grace:
    pod = int(params["k8s_termination_grace_s"])
    return Grace(pod_s=pod, agent_s=pod - GRACE_MARGIN_S, rank_s=pod - 2 * GRACE_MARGIN_S)


def in_store(params: dict[str, Any]) -> bool:
    """Checkpoints straight to the store (no volume, no upload pod), or on the PVC."""
    return params.get("checkpoint_location", "store") == "store"


def pod_mesh(params: dict[str, Any]) -> dict[str, int]:
    """FSDP over several pods of several GPUs each, the mesh left at its default: HSDP, sharded
    within a pod (over its NVLink) and replicated across pods (one all-reduce of the shards over
    the slower network per step), ``dp_replicate`` following the pod count, so an elastic run
    keeps it. CPU pods hold one rank each: there FSDP shards across the pods, as it must to split
    a model no pod holds. A mesh the user shaped is kept."""
    default = (int(params.get("dp_replicate", 1)), int(params.get("dp_shard", -1))) == (1, -1)
    if params.get("strategy") == "fsdp" and default and node_range(params)[1] > 1 and procs_per_node(params) > 1:
        return {"dp_replicate": -1, "dp_shard": procs_per_node(params)}
    return {}


def pod_train_config(params: dict[str, Any], *, run_dir: str, run_id: str, world_size: int | None = None,
                     token_shards: str = "") -> dict[str, Any]:
    """The TrainConfig the pods run, built by the same code as the local backend's. With the
    checkpoints in the store the run's records (steps.jsonl...) stay in the pod's /tmp; text is
    read from its token windows in the store (``token_shards``)."""
    from training.checkpoint.commit import run_uri
    from training_airflow import run_config

    if in_store(params):
        where = {"checkpoint_dir": run_uri(params["store_uri"], params["experiment"], run_id), "output_dir": "/tmp/output"}
    else:
        where = {"checkpoint_dir": f"{run_dir}/checkpoints", "output_dir": f"{run_dir}/output"}
    # The preemption grace is the pod's (``grace``), not the local backend's Param.
    cfg = run_config.train_config({**params, **pod_mesh(params), "preempt_grace_s": grace(params).rank_s},
                               world_size=world_size or world_sizes(params)[-1], token_shards=token_shards,
                               **where).to_dict()
    if not str(cfg["dataset_uri"]).startswith("s3://"):  # the pods read an s3:// dataset themselves
        cfg["dataset_uri"] = params["k8s_dataset_path"]
    if cfg["metrics_port"]:  # the ranks' metrics listen on the pod's IP, which Kubernetes puts in
        cfg["metrics_host"] = f"$({POD_IP_ENV})"
    return cfg


POD_IP_ENV = "POD_IP"
POD_IP_ARG = f"metrics_host=$({POD_IP_ENV})"  # the one argument Kubernetes is to expand


def _escape(value: str) -> str:
    # Kubernetes expands $(VAR) in command and args; `$$` is its escape for a literal `$`.
    return value.replace("$(", "$$(")


def set_args(cfg: dict[str, Any]) -> list[str]:
    """A TrainConfig as `--set key=value` arguments (the trainer's CLI contract), escaped for Kubernetes."""
    from training.config.train_config import TrainConfig
    from training.config.fields import set_args as to_set_args

    return [a if a == POD_IP_ARG else _escape(a) for a in to_set_args(TrainConfig, cfg)]

# --------------------------------------------------------------------------- objects


def labels(names_: Names, component: str) -> dict[str, str]:
    out = {APP_LABEL: APP, COMPONENT_LABEL: component}
    if component == "trainer":
        out[RDZV_LABEL] = names_.service  # what the Service selects: this run's training pods only
    return out


def service_manifest(names_: Names) -> dict[str, Any]:
    """Headless Service: no virtual IP, one DNS record per selected pod (`<hostname>.<service>`)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names_.service, "namespace": names_.namespace,
                     "labels": {APP_LABEL: APP, COMPONENT_LABEL: "rendezvous"}},
        "spec": {
            "clusterIP": "None",
            "selector": {RDZV_LABEL: names_.service},
            # Records exist before the pods are Ready: rendezvous happens while they start.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "c10d", "port": names_.rdzv_port, "targetPort": names_.rdzv_port, "protocol": "TCP"}],
        },
    }


def service_yaml(names_: Names) -> str:
    return yaml.safe_dump(service_manifest(names_), sort_keys=False)


def pod_security_context() -> k8s.V1PodSecurityContext:
    return k8s.V1PodSecurityContext(
        run_as_non_root=True, run_as_user=RUN_UID, run_as_group=RUN_UID,
        fs_group=RUN_UID, fs_group_change_policy="OnRootMismatch",  # the PVCs become writable by the user
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security_context() -> k8s.V1SecurityContext:
    return k8s.V1SecurityContext(
        run_as_non_root=True, allow_privilege_escalation=False, read_only_root_filesystem=True,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
    )


def _base_env() -> list[k8s.V1EnvVar]:
    # The root filesystem is read-only: caches and temporary files go to the /tmp volume.
    return [k8s.V1EnvVar(name="HOME", value="/tmp"), k8s.V1EnvVar(name="TMPDIR", value="/tmp"),
            k8s.V1EnvVar(name="PYTHONDONTWRITEBYTECODE", value="1"), k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1")]


METRICS_PORT_NAME = "metrics-{}"  # + the local rank; deploy/kubernetes/podmonitor.yaml lists metrics-0..7


def _field(path: str) -> k8s.V1EnvVarSource:
    return k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path))


def pod_ip_env() -> k8s.V1EnvVar:
    return k8s.V1EnvVar(name=POD_IP_ENV, value_from=_field("status.podIP"))


def metrics_env(params: dict[str, Any], dag_run_id: str) -> list[k8s.V1EnvVar]:
    """The ranks' metric labels (training/metrics/live.py) and the address they listen on."""
    from training.metrics.live import DAG_RUN_ENV, EXPERIMENT_ENV, NODE_ENV

    return [pod_ip_env(), k8s.V1EnvVar(name=NODE_ENV, value_from=_field("spec.nodeName")),
            k8s.V1EnvVar(name=EXPERIMENT_ENV, value=str(params["experiment"])),
            k8s.V1EnvVar(name=DAG_RUN_ENV, value=dag_run_id)]


def metrics_ports(params: dict[str, Any], cfg: dict[str, Any]) -> tuple[list[k8s.V1ContainerPort], dict[str, str]]:
    """One named container port per rank of a pod, and the classic scrape annotations (which
    name one port: local rank 0's; the PodMonitor scrapes every rank). None when metrics_port is 0."""
    base = int(cfg.get("metrics_port") or 0)
    if not base:
        return [], {}
    ports = [k8s.V1ContainerPort(name=METRICS_PORT_NAME.format(i), container_port=base + i, protocol="TCP")
             for i in range(procs_per_node(params))]
    return ports, {"prometheus.io/scrape": "true", "prometheus.io/port": str(base), "prometheus.io/path": "/metrics"}


def s3_secret(params: dict[str, Any]) -> str:
    """The Secret the pods' S3 keys come from: the runtime's (the deployment's policy), else ``k8s_s3_secret``."""
    return policy.runtime_of(params).s3_secret or params["k8s_s3_secret"]


def mlflow_env(params: dict[str, Any]) -> list[k8s.V1EnvVar]:
    """MLflow's basic-auth credentials by reference to the runtime's Secret (none: no credentials)."""
    secret = policy.runtime_of(params).mlflow_secret
    return [k8s.V1EnvVar(name=var, value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=var)))
        for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")] if secret else []


def s3_env(secret: str) -> list[k8s.V1EnvVar]:
    """S3 settings by reference to a Secret: the values never appear in the pod spec."""
    return [k8s.V1EnvVar(name=var, value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=var, optional=optional)))
        for var, optional in S3_ENV.items()]


def _volumes(params: dict[str, Any], *, trainer: bool) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """A writable /tmp and, unless the checkpoints go to the store, the checkpoint volume
    (read-write for the trainer, read-only for the upload); the trainer also gets the dataset
    (read-only) and an in-memory /dev/shm."""
    vols = [k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource(
                size_limit=params.get("k8s_scratch_size", "4Gi") if trainer else "4Gi"))]
    mounts = [k8s.V1VolumeMount(name="tmp", mount_path="/tmp")]
    if not (trainer and in_store(params)):
        vols.insert(0, k8s.V1Volume(name="checkpoints", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=params["k8s_checkpoint_pvc"])))
        mounts.insert(0, k8s.V1VolumeMount(name="checkpoints", mount_path=CHECKPOINT_MOUNT, read_only=not trainer))
    if trainer:
        vols.append(k8s.V1Volume(name="data", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=params["k8s_data_pvc"], read_only=True)))
        mounts.append(k8s.V1VolumeMount(name="data", mount_path=DATA_MOUNT, read_only=True))
        vols.append(k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(
            medium="Memory", size_limit=params["k8s_shm_size"])))
        mounts.append(k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    return vols, mounts


def trainer_resources(params: dict[str, Any]) -> k8s.V1ResourceRequirements:
    limits = {"cpu": params["k8s_cpu_limit"], "memory": params["k8s_memory_limit"]}
    gpus = int(params["k8s_gpus_per_node"])
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)  # extended resource: the request defaults to the limit
    return k8s.V1ResourceRequirements(requests={"cpu": params["k8s_cpu_request"], "memory": params["k8s_memory_request"]},
                                      limits=limits)


def _common_pod_kwargs(params: dict[str, Any], names_: Names) -> dict[str, Any]:
    runtime = policy.runtime_of(params)  # the platform's placement and Secrets win over the Params
    pull_secret = runtime.image_pull_secret or params.get("k8s_image_pull_secret")
    pull = [k8s.V1LocalObjectReference(name=pull_secret)] if pull_secret else []
    selector = {**{str(k): str(v) for k, v in dict(params.get("k8s_node_selector") or {}).items()}, **runtime.node_selector}
    return {
        "kubernetes_conn_id": params["kubernetes_conn_id"],
        "namespace": names_.namespace,
        "image": params["k8s_image"],
        "image_pull_policy": params["k8s_image_pull_policy"],
        "image_pull_secrets": pull,
        "security_context": pod_security_context(),
        "container_security_context": container_security_context(),
        "automount_service_account_token": False,  # the pods never talk to the Kubernetes API
        "node_selector": selector,
        **({"service_account_name": runtime.service_account} if runtime.service_account else {}),
    }


def rdzv_conf(params: dict[str, Any]) -> str:
    """torchrun --rdzv-conf: how long to wait for the store on pod 0 (read_timeout) and for the
    minimum of nodes (join_timeout), both ``k8s_rdzv_timeout_s``; then RDZV_LAST_CALL_S for more;
    and how soon a dead node is declared dead (keep-alives)."""
    timeout = int(params["k8s_rdzv_timeout_s"])
    return (f"join_timeout={timeout},read_timeout={timeout},last_call_timeout={min(RDZV_LAST_CALL_S, timeout)},"
            f"keep_alive_interval={RDZV_KEEP_ALIVE_S},keep_alive_max_attempt={RDZV_KEEP_ALIVE_MISSES}")


def torchrun_args(params: dict[str, Any], names_: Names, cfg: dict[str, Any]) -> list[str]:
    """The pods' torchrun arguments (what follows LAUNCHER, which parses them as torchrun does)."""
    from training.distributed.launch import torchrun_command

    nmin, nmax = node_range(params)
    cmd = torchrun_command(set_args(cfg), nproc_per_node=procs_per_node(params), nnodes=f"{nmin}:{nmax}",
                           max_restarts=int(params["max_restarts"]), rdzv_endpoint=names_.rdzv_endpoint,
                           rdzv_id=names_.job, python=None,
                           options=["--rdzv-conf", rdzv_conf(params), "--shutdown-timeout", str(grace(params).agent_s)])
    return cmd[1:]


def pod_failure_policy() -> k8s.V1PodFailurePolicy:
    return k8s.V1PodFailurePolicy(rules=[
        # Bad input: the same pod would fail the same way on every retry.
        k8s.V1PodFailurePolicyRule(action="FailJob", on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
            operator="In", values=[EXIT_BAD_INPUT])),
        # Preempted after a checkpoint (the launcher's exit code): the replacement pod resumes from it.
        k8s.V1PodFailurePolicyRule(action="Ignore", on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
            container_name=BASE_CONTAINER, operator="In", values=[EXIT_PREEMPTED])),
        # Preemption, eviction, node drain: not the pod's fault; a replacement does not count
        # against backoffLimit and resumes from the latest checkpoint (store or shared volume).
        k8s.V1PodFailurePolicyRule(action="Ignore", on_pod_conditions=[
            k8s.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")]),
    ])


def success_policy() -> k8s.V1SuccessPolicy:
    """The Job is done when pod 0 succeeds: its agent exits 0 only after the ranks of every pod
    finished (torchrun's exit barrier). An Indexed Job otherwise waits for every index, and after
    an elastic scale-down the lost pod's replacement can never succeed: the run it would join has
    ended. (successPolicy: Kubernetes 1.31 and later; older API servers ignore it.)"""
    return k8s.V1SuccessPolicy(rules=[k8s.V1SuccessPolicyRule(succeeded_indexes="0")])


def job_operator_kwargs(params: dict[str, Any], names_: Names, *, mlflow_run_id: str, tracking_uri: str,
                        train_config: dict[str, Any], dag_run_id: str = "") -> dict[str, Any]:
    """Arguments of ``KubernetesJobOperator`` for this run (on top of JOB_STATIC_KWARGS)."""
    n = int(params["k8s_nnodes"])
    ports, annotations = metrics_ports(params, train_config)
    volumes, mounts = _volumes(params, trainer=True)
    env = [*_base_env(),
           k8s.V1EnvVar(name="MLFLOW_TRACKING_URI", value=tracking_uri),
           k8s.V1EnvVar(name="MLFLOW_RUN_ID", value=mlflow_run_id),
           *metrics_env(params, dag_run_id),
           *mlflow_env(params),
           *s3_env(s3_secret(params)),
           *[k8s.V1EnvVar(name=k, value=str(v)) for k, v in sorted(dict(params.get("k8s_nccl_env") or {}).items())]]
    check = k8s.V1Container(
        name=CHECK_CONTAINER, image=params["k8s_image"], image_pull_policy=params["k8s_image_pull_policy"],
        # With the checkpoints in the store it also lists and writes the run's place there with the
        # pods' own S3 Secret: a missing bucket or refused keys fail the Job at once (exit 2).
        command=["python", "-m", "training", "train", "--print-config", *(["--check-access"] if in_store(params) else []),
                 *set_args(train_config)],
        env=[*_base_env(), pod_ip_env(), *(s3_env(s3_secret(params)) if in_store(params) else [])],
        security_context=container_security_context(),
        resources=k8s.V1ResourceRequirements(requests={"cpu": "100m", "memory": "256Mi"},
                                             limits={"cpu": "1", "memory": "1Gi"}),
        volume_mounts=[k8s.V1VolumeMount(name="tmp", mount_path="/tmp")],
    )
    tolerations = ([k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]
                   if int(params["k8s_gpus_per_node"]) else [])
    tolerations += [k8s.V1Toleration(**t.model_dump(exclude_none=True)) for t in policy.runtime_of(params).tolerations]
    return {
        **_common_pod_kwargs(params, names_),
        "name": names_.job_base,
        "labels": labels(names_, "trainer"),
        "cmds": LAUNCHER,
        "arguments": torchrun_args(params, names_, train_config),
        "env_vars": env,
        "ports": ports,
        "annotations": annotations,
        "volumes": volumes,
        "volume_mounts": mounts,
        "container_resources": trainer_resources(params),
        "init_containers": [check],
        "subdomain": names_.service,
        "tolerations": tolerations,
        "termination_grace_period": grace(params).pod_s,
        "active_deadline_seconds": int(params["k8s_active_deadline_s"]),
        "completion_mode": "Indexed",
        "completions": n,
        "parallelism": n,
        "backoff_limit": int(params["k8s_backoff_limit"]),
        "ttl_seconds_after_finished": int(params["k8s_ttl_after_finished_s"]),
        # podFailurePolicy and successPolicy are no operator arguments: they come in through the
        # base Job the operator merges.
        "full_job_spec": k8s.V1Job(spec=k8s.V1JobSpec(template=k8s.V1PodTemplateSpec(),
                                                      pod_failure_policy=pod_failure_policy(),
                                                      success_policy=success_policy())),
    }


def final_checkpoint_dir(params: dict[str, Any], names_: Names) -> str:
    """The trainer always ends at `steps` and names the folder step_XXXXXXXX (training/checkpoint/commit.py)."""
    return f"{names_.run_dir}/checkpoints/step_{int(params['steps']):08d}"


def upload_pod_kwargs(params: dict[str, Any], names_: Names, *, mlflow_run_id: str) -> dict[str, Any]:
    """Arguments of ``KubernetesPodOperator`` for the pod that commits the final checkpoint."""
    volumes, mounts = _volumes(params, trainer=False)
    return {
        **_common_pod_kwargs(params, names_),
        "name": names_.upload_pod,
        "labels": labels(names_, "upload"),
        "cmds": ["python", "-m", "training", "upload"],
        "arguments": [_escape(a) for a in (
            "--checkpoint", final_checkpoint_dir(params, names_), "--store-uri", params["store_uri"],
            "--experiment", params["experiment"], "--run-id", mlflow_run_id)],
        "env_vars": [*_base_env(), *s3_env(s3_secret(params))],
        "volumes": volumes,
        "volume_mounts": mounts,
        # Upload streams files in 16 MiB parts: small and steady whatever the checkpoint size.
        "container_resources": k8s.V1ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"},
                                                          limits={"cpu": "2", "memory": "4Gi"}),
        "termination_grace_period": 30,
    }


# --------------------------------------------------------------------------- worker side


def job_wall_s(job: dict[str, Any] | None) -> float:
    """Start to completion of the Job as Kubernetes recorded it (scheduling and image pulls included)."""
    status = (job or {}).get("status") or {}
    start, end = status.get("start_time"), status.get("completion_time")
    if not start or not end:
        return 0.0
    parse = lambda v: v if isinstance(v, datetime) else datetime.fromisoformat(str(v).replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


