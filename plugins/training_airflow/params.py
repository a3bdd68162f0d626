"""Typed, titled Params of the ``distributed_training`` DAG: they render as the trigger form.

The JSON-schema keywords (type, enum, minimum, pattern) are enforced by Airflow when a run is
triggered; cross-field rules the form cannot express are checked by the first task (see
``tasks.check_conf``) before anything is computed.
"""

from __future__ import annotations

from airflow.sdk import Param

from training_airflow import settings

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def training_params() -> dict[str, Param]:
    return {
        "dataset_uri": Param(
            settings.default_dataset_uri(), type="string", minLength=1, title="Dataset",
            description="Folder written by `python -m training make-data` (train/, validation/, dataset.json). "
                        "Relative paths are relative to the project folder."),
        "experiment": Param(
            "distributed_training", type="string", pattern=NAME_PATTERN, title="MLflow experiment",
            description="MLflow experiment the run is recorded in; also the first part of checkpoint keys."),
        "model": Param("mlp", type="string", enum=["mlp", "cnn", "transformer"], title="Model",
                       description="Model family, matching the dataset kind: mlp (tabular, make-data --kind teacher), "
                                   "cnn (8x8 images, --kind digits), transformer (tokens, --kind markov)."),
        "strategy": Param("ddp", type="string", enum=["ddp", "fsdp"], title="Strategy",
                          description="ddp: a replica per rank, bucketed all-reduce overlapped with backward. "
                                      "fsdp: FSDP2 fully_shard per block (parameters, gradients, optimizer state sharded)."),
        "precision": Param("fp32", type="string", enum=["fp32", "bf16", "fp16"], title="Precision",
                           description="fp32; bf16 (autocast, or FSDP2 mixed precision); fp16 (autocast + dynamic "
                                       "loss scaling, ddp only)."),
        "comm_hook": Param("none", type="string", enum=["none", "fp16", "bf16"], title="Gradient compression (DDP)",
                           description="Compress DDP gradients before the all-reduce: none, fp16, bf16 (bf16 needs GPUs)."),
        "grad_accum": Param(1, type="integer", minimum=1, maximum=1024, title="Gradient accumulation",
                            description="Micro-batches per optimizer step; only the last one communicates. The global "
                                        "batch must be divisible by world size x grad_accum."),
        "world_size": Param(2, type="integer", minimum=1, maximum=64, title="World size (ranks)",
                            description="Number of training processes (torchrun --nproc-per-node)."),
        "steps": Param(300, type="integer", minimum=1, maximum=10_000_000, title="Steps",
                       description="Optimizer steps in total."),
        "batch_size": Param(64, type="integer", minimum=1, maximum=1_048_576, title="Global batch size",
                            description="Samples per optimizer step over all ranks; must be divisible by world size x grad_accum."),
        "lr": Param(3e-3, type="number", exclusiveMinimum=0, maximum=10, title="Learning rate",
                    description="Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."),
        "seed": Param(1234, type="integer", minimum=0, title="Seed",
                      description="Seed for weights, data order and every RNG; the same seed reproduces the run."),
        "checkpoint_every": Param(100, type="integer", minimum=0, title="Checkpoint every K steps",
                                  description="Periodic local checkpoints (0 = only the final one). A retried train task resumes from the latest."),
        "eval_every": Param(50, type="integer", minimum=0, maximum=10_000_000, title="Evaluate every N steps",
                            description="Score the validation split during training every N steps: eval/loss and "
                                        "eval/accuracy curves in MLflow (0 = off; the evaluate task still scores the "
                                        "final checkpoint)."),
        "target_metric": Param("none", type="string", enum=["none", "eval/accuracy", "eval/loss"], title="Target metric",
                               description="Time-to-train: log time_to_target_s and steps_to_target the first time "
                                           "this metric reaches the target value (none = no target). Needs "
                                           "eval_every > 0."),
        "target_value": Param(None, type=["null", "number"], minimum=0, title="Target value",
                              description="Accuracy at least this (0-1], or loss at most this. Required with a "
                                          "target metric."),
        "store_uri": Param(
            settings.default_store_uri(), type="string", pattern=r"^(file|s3)://.+", title="Checkpoint store",
            description="Where the final checkpoint is committed: file:///folder or s3://bucket/prefix. "
                        "S3 endpoint and credentials come from the connection in aws_conn_id or the worker's "
                        "AWS_* environment, never from here."),
        "aws_conn_id": Param(
            None, type=["null", "string"], pattern=r"^([A-Za-z0-9_.-]{1,250})?$", title="AWS connection",
            description="Airflow connection (type Amazon Web Services) with the S3 keys, region and endpoint_url "
                        "(extra) for an s3:// store. Empty: the worker's AWS_* environment. The keys reach the "
                        "store as environment only, never a command line, XCom or MLflow."),
        "retention_keep_last": Param(
            3, type="integer", minimum=0, maximum=1000, title="Keep last K checkpoints",
            description="After evaluation, the run's stored checkpoints are pruned to the last K, plus the best "
                        "by eval/loss and whatever `latest` names (never deleted). 0 keeps all."),
        "max_restarts": Param(0, type="integer", minimum=0, maximum=10, title="torchrun max restarts",
                              description="How often torchrun restarts the rank group after a rank dies."),
        "backend": Param(
            "local", type="string", enum=["local", "kubernetes"], title="Backend",
            description="local: torchrun on the Airflow worker (world_size ranks). kubernetes: an Indexed Job of "
                        "k8s_nnodes pods on a cluster (see the Kubernetes fields); world_size is then ignored."),
        **kubernetes_params(),
        "registered_model": Param(
            None, type=["null", "string"], pattern=NAME_PATTERN, title="Registered model",
            description="MLflow registered model that `evaluate` registers the trained model under. "
                        "Empty: the experiment name."),
        "promotion_margin": Param(
            0.005, type="number", minimum=0, maximum=1, title="Promotion margin",
            description="The new model takes the registry alias `champion` only if its eval/accuracy beats the "
                        "current champion's by more than this (absolute: 0.005 = half a percentage point). "
                        "Otherwise it is registered as a challenger and the run says why."),
    }


DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"
K8S = "Kubernetes backend"


def kubernetes_params() -> dict[str, Param]:
    """Fields of the ``backend=kubernetes`` path; nothing cluster-specific is hard-coded elsewhere.

    Cross-field rules (limits >= requests, an s3:// store, an MLflow server the pods can reach, the
    batch size against every possible world size) are checked by ``kubernetes.check_params``.
    """

    def name(default: str, title: str, description: str) -> Param:
        return Param(default, type="string", pattern=DNS_LABEL, minLength=1, maxLength=63, title=title,
                     description=description, section=K8S)

    def quantity(default: str, title: str, description: str) -> Param:
        return Param(default, type="string", pattern=QUANTITY, title=title, description=description, section=K8S)

    def seconds(default: int, title: str, description: str, minimum: int = 1) -> Param:
        return Param(default, type="integer", minimum=minimum, maximum=30 * 86400, title=title,
                     description=description, section=K8S)

    return {
        "kubernetes_conn_id": Param(
            "kubernetes_default", type="string", pattern=r"^[A-Za-z0-9_.-]{1,250}$", title="Kubernetes connection",
            description="Airflow connection of the cluster (kubeconfig or in-cluster). A missing "
                        "`kubernetes_default` means the worker's own kubeconfig / service account.", section=K8S),
        "k8s_namespace": name("training", "Namespace", "Namespace of the Service, the Job and the upload pod; "
                              "it must exist and hold the PVCs and the Secret."),
        "k8s_image": Param(
            "distributed-training:latest", type="string", pattern=r"^[^\s]+$", title="Training image",
            description="Image built from docker/training.Dockerfile (push it to a registry the cluster can pull from).",
            section=K8S),
        "k8s_image_pull_policy": Param("IfNotPresent", type="string", enum=["IfNotPresent", "Always", "Never"],
                                       title="Image pull policy", description="Kubernetes imagePullPolicy of every container.",
                                       section=K8S),
        "k8s_image_pull_secret": Param(
            None, type=["null", "string"], pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", maxLength=253, title="Image pull Secret",
            description="Secret with registry credentials for a private registry; empty: none.", section=K8S),
        "k8s_nnodes": Param(2, type="integer", minimum=1, maximum=256, title="Nodes (pods)",
                            description="Pods of the Indexed Job (completions = parallelism = this); torchrun --nnodes max.",
                            section=K8S),
        "k8s_min_nodes": Param(0, type="integer", minimum=0, maximum=256, title="Minimum nodes",
                               description="torchrun --nnodes min: the run goes on with this many pods while a lost "
                                           "one is replaced. 0: same as Nodes (no elasticity).", section=K8S),
        "k8s_gpus_per_node": Param(1, type="integer", minimum=0, maximum=16, title="GPUs per pod",
                                   description="nvidia.com/gpu limit and torchrun --nproc-per-node. 0: CPU pods with one "
                                               "rank each (clusters without GPUs, e.g. for a smoke test).", section=K8S),
        "k8s_cpu_request": quantity("4", "CPU request", "CPU request of a training pod (Kubernetes quantity, e.g. 4 or 500m)."),
        "k8s_cpu_limit": quantity("8", "CPU limit", "CPU limit of a training pod; at least the request."),
        "k8s_memory_request": quantity("16Gi", "Memory request", "Memory request of a training pod (e.g. 16Gi)."),
        "k8s_memory_limit": quantity("32Gi", "Memory limit", "Memory limit of a training pod; at least the request."),
        "k8s_shm_size": quantity("8Gi", "/dev/shm size", "Size of the in-memory /dev/shm volume (data loader workers, NCCL). "
                                                          "It counts against the memory limit."),
        "k8s_checkpoint_pvc": name("training-checkpoints", "Checkpoint PVC",
                                   "ReadWriteMany PersistentVolumeClaim mounted at /checkpoints in every pod; ranks "
                                   "write checkpoints there and a retried Job resumes from them."),
        "k8s_data_pvc": name("training-data", "Dataset PVC", "PersistentVolumeClaim mounted read-only at /data."),
        "k8s_dataset_path": Param(
            "/data/teacher", type="string", pattern=r"^/data/[A-Za-z0-9._/-]+$", title="Dataset path in the pods",
            description="The dataset folder as the pods see it (under /data). validate_data checks dataset_uri on the "
                        "worker: both must be the same data.", section=K8S),
        "k8s_s3_secret": name("training-s3", "S3 Secret",
                              "Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optionally AWS_ENDPOINT_URL, "
                              "AWS_DEFAULT_REGION; pods get them by reference, never as values."),
        "k8s_mlflow_tracking_uri": Param(
            None, type=["null", "string"], pattern=r"^(https?://[^\s@]+)?$", title="MLflow URI for the pods",
            description="http(s) address of the MLflow server as seen from the pods. Empty: the worker's "
                        "MLFLOW_TRACKING_URI, which must then be http(s).", section=K8S),
        "k8s_rdzv_port": Param(29400, type="integer", minimum=1024, maximum=65535, title="Rendezvous port",
                               description="Port of torchrun's c10d rendezvous store on pod 0.", section=K8S),
        "k8s_cluster_domain": Param(
            "cluster.local", type="string", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", title="Cluster DNS domain",
            description="DNS domain of the cluster; pod 0's rendezvous name ends with it.", section=K8S),
        "k8s_backoff_limit": Param(3, type="integer", minimum=0, maximum=100, title="Job backoffLimit",
                                   description="Failed pods the Job tolerates before it fails. Configuration errors "
                                               "(exit code 2) fail it at once; evictions and preemptions do not count.",
                                   section=K8S),
        "k8s_active_deadline_s": seconds(86400, "Job deadline (s)", "activeDeadlineSeconds: the Job fails after this long."),
        "k8s_ttl_after_finished_s": seconds(86400, "Keep finished Job (s)",
                                            "ttlSecondsAfterFinished: a finished Job and its pods are removed after this long.",
                                            minimum=0),
        "k8s_termination_grace_s": seconds(120, "Termination grace (s)",
                                           "Time a preempted pod gets between SIGTERM and SIGKILL (to write a checkpoint)."),
        "k8s_node_selector": Param({}, type="object", additionalProperties={"type": "string"}, title="Node selector",
                                   description="Labels a training node must have, e.g. {\"nvidia.com/gpu.product\": \"NVIDIA-H100-80GB-HBM3\"}.",
                                   section=K8S),
        "k8s_nccl_env": Param(
            {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, type="object",
            additionalProperties={"type": "string"}, propertyNames={"pattern": "^(NCCL|TORCH_NCCL)_[A-Z0-9_]+$"},
            title="NCCL settings", description="NCCL_* / TORCH_NCCL_* variables of the training containers "
                                               "(e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA for your fabric).", section=K8S),
    }
