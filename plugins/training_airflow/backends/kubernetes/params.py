"""The Kubernetes backend's fields of the trigger form, declared once (``training.config.fields.knob``).

Nothing cluster-specific is hard-coded elsewhere. Each field's own pattern and limits are checked
by the form (and Airflow's REST API) when a run is created; rules between fields (limits >=
requests, an s3:// store, an MLflow server the pods can reach, the batch size against every world
size the run may have) by ``checks.check_params`` before anything exists on the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from training.config.fields import knob

SECTION = "Kubernetes backend"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"
NCCL_NAME = r"^(NCCL|TORCH_NCCL)_[A-Z0-9_]+$"
_NAME = {"minLength": 1, "maxLength": 63}
_DAY = 86_400


def _k8s(default, help: str, **kw):
    return knob(default, help, section=SECTION, **kw)


@dataclass(kw_only=True)
class KubernetesParams:
    kubernetes_conn_id: str = _k8s(
        "kubernetes_default", "Airflow connection of the cluster (kubeconfig or in-cluster); a missing "
        "kubernetes_default means the worker's own kubeconfig / service account", title="Kubernetes connection",
        pattern=r"^[A-Za-z0-9_.-]{1,250}$")
    k8s_namespace: str = _k8s("training", "namespace of the Service, the Job and the upload pod; it must exist and "
                              "hold the PVCs and the Secret", title="Namespace", pattern=DNS_LABEL, schema=_NAME)
    k8s_image: str = _k8s("distributed-training:latest", "image built from docker/training.Dockerfile (push it to a "
                          "registry the cluster can pull from)", title="Training image", pattern=r"^[^\s]+$")
    k8s_image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = _k8s(
        "IfNotPresent", "Kubernetes imagePullPolicy of every container", title="Image pull policy")
    k8s_image_pull_secret: str | None = _k8s(
        None, "Secret with registry credentials for a private registry; empty: none", title="Image pull Secret",
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", schema={"maxLength": 253})
    k8s_nnodes: int = _k8s(2, "pods of the Indexed Job (completions = parallelism = this); torchrun --nnodes max",
                           title="Nodes (pods)", minimum=1, maximum=256)
    k8s_min_nodes: int = _k8s(0, "torchrun --nnodes min: the run goes on with this many pods while a lost one is "
                              "replaced; 0: same as Nodes (no elasticity)", title="Minimum nodes", minimum=0, maximum=256)
    k8s_gpus_per_node: int = _k8s(1, "nvidia.com/gpu limit and torchrun --nproc-per-node; 0: CPU pods with one rank "
                                  "each (clusters without GPUs, e.g. for a smoke test)", title="GPUs per pod",
                                  minimum=0, maximum=16)
    k8s_cpu_request: str = _k8s("4", "CPU request of a training pod (Kubernetes quantity, e.g. 4 or 500m)",
                                title="CPU request", pattern=QUANTITY)
    k8s_cpu_limit: str = _k8s("8", "CPU limit of a training pod; at least the request", title="CPU limit",
                              pattern=QUANTITY)
    k8s_memory_request: str = _k8s("16Gi", "memory request of a training pod (e.g. 16Gi)", title="Memory request",
                                   pattern=QUANTITY)
    k8s_memory_limit: str = _k8s("32Gi", "memory limit of a training pod; at least the request",
                                 title="Memory limit", pattern=QUANTITY)
    k8s_shm_size: str = _k8s("8Gi", "size of the in-memory /dev/shm volume (data loader workers, NCCL); it counts "
                             "against the memory limit", title="/dev/shm size", pattern=QUANTITY)
    k8s_checkpoint_pvc: str = _k8s(
        "training-checkpoints", "with checkpoint_location=local only: ReadWriteMany PersistentVolumeClaim mounted at "
        "/checkpoints in every pod; ranks write checkpoints there, a retried Job resumes from them and an upload pod "
        "commits the final one to the store", title="Checkpoint PVC", pattern=DNS_LABEL, schema=_NAME)
    k8s_scratch_size: str = _k8s(
        "20Gi", "size limit of a training pod's writable /tmp (emptyDir): with checkpoint_location=store each rank "
        "downloads there the checkpoint files it reads on resume (its shard; with ddp the whole checkpoint) and rank "
        "0 exports the final model there", title="Scratch (/tmp) size", pattern=QUANTITY)
    k8s_data_pvc: str = _k8s("training-data", "PersistentVolumeClaim mounted read-only at /data",
                             title="Dataset PVC", pattern=DNS_LABEL, schema=_NAME)
    k8s_dataset_path: str = _k8s(
        "/data/teacher", "the dataset folder as the pods see it (under /data); validate_data checks dataset_uri on "
        "the worker: both must be the same data", title="Dataset path in the pods", pattern=r"^/data/[A-Za-z0-9._/-]+$")
    k8s_s3_secret: str = _k8s(
        "training-s3", "Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_ENDPOINT_URL, "
        "AWS_DEFAULT_REGION; pods get them by reference, never as values", title="S3 Secret", pattern=DNS_LABEL,
        schema=_NAME)
    k8s_mlflow_tracking_uri: str | None = _k8s(
        None, "http(s) address of the MLflow server as seen from the pods; empty: the worker's MLFLOW_TRACKING_URI, "
        "which must then be http(s)", title="MLflow URI for the pods", pattern=r"^(https?://[^\s@]+)?$")
    k8s_rdzv_port: int = _k8s(29400, "port of torchrun's c10d rendezvous store on pod 0", title="Rendezvous port",
                              minimum=1024, maximum=65535)
    k8s_cluster_domain: str = _k8s("cluster.local", "DNS domain of the cluster; pod 0's rendezvous name ends with it",
                                   title="Cluster DNS domain", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    k8s_backoff_limit: int = _k8s(3, "failed pods the Job tolerates before it fails; configuration errors (exit code "
                                  "2) fail it at once, evictions and preemptions do not count", title="Job backoffLimit",
                                  minimum=0, maximum=100)
    k8s_active_deadline_s: int = _k8s(_DAY, "activeDeadlineSeconds: the Job fails after this long",
                                      title="Job deadline (s)", minimum=1, maximum=30 * _DAY)
    k8s_ttl_after_finished_s: int = _k8s(_DAY, "ttlSecondsAfterFinished: a finished Job and its pods are removed "
                                         "after this long", title="Keep finished Job (s)", minimum=0, maximum=30 * _DAY)
    k8s_termination_grace_s: int = _k8s(
        120, "terminationGracePeriodSeconds: a preempted pod's time between SIGTERM and SIGKILL to write a "
        "checkpoint. torchrun's --shutdown-timeout (this minus 5 s) and the trainer's preempt_grace_s (this minus "
        "10 s) are derived from it, so each layer gives up before the next one kills it", title="Termination grace (s)",
        minimum=15, maximum=30 * _DAY)
    k8s_rdzv_timeout_s: int = _k8s(
        300, "how long a pod waits at a rendezvous: for the store on pod 0, and for at least Minimum nodes pods; a "
        "pod that cannot rendezvous (wrong port, blocked network, pods that never start) fails after this long "
        "naming the cause", title="Rendezvous timeout (s)", minimum=10, maximum=_DAY)
    k8s_startup_timeout_s: int = _k8s(
        300, "how long a training pod may stay unschedulable (e.g. a node selector no node matches) or unable to "
        "start its containers (image pull errors, a missing Secret) before the task fails naming the cause",
        title="Pod start timeout (s)", minimum=10, maximum=_DAY)
    k8s_node_selector: dict[str, str] = _k8s(
        {}, 'labels a training node must have, e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}',
        title="Node selector")
    k8s_nccl_env: dict[str, str] = _k8s(
        {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        "NCCL_* / TORCH_NCCL_* variables of the training containers (e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA for your "
        "fabric)", title="NCCL settings", schema={"propertyNames": {"pattern": NCCL_NAME}})
