"""Checks of a Kubernetes run before anything exists on the cluster (``open_run`` calls them).

Each field's own type, pattern and limits come from its declaration (``params.KubernetesParams``)
and are checked again here, since a Param set through ``dag.test`` or an old run's conf never
went through the form. Then the rules between fields: an s3:// store both the pods and the worker
reach, requests not above limits, /dev/shm inside the memory limit, an MLflow server the pods can
log into (not loopback, no credentials in the address), and the trainer's own rules for every
world size the run may have. Every mistake raises ``ConfigError`` naming the field and the fix.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

from training.config.fields import ConfigError, check_value, specs
from training_airflow.backends.kubernetes.params import NCCL_NAME, KubernetesParams
from training_airflow.backends.kubernetes.spec import CHECKPOINT_MOUNT, DATA_MOUNT, node_range, pod_train_config, world_sizes


def pod_tracking_uri(params: dict[str, Any], worker_uri: str | None) -> str:
    """The MLflow address the pods use: the Param, else the worker's own if the pods can reach it."""
    uri = params.get("k8s_mlflow_tracking_uri") or worker_uri or ""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        what = f"a {parsed.scheme}:// store" if parsed.scheme else "no address"  # never echo the URI: it may hold a password
        raise ConfigError("k8s_mlflow_tracking_uri", f"the pods need an MLflow server and got {what}",
                          "set k8s_mlflow_tracking_uri to the http(s) address of the MLflow server as the pods see it")
    if parsed.username or parsed.password:
        raise ConfigError("k8s_mlflow_tracking_uri", "the address carries credentials, which would end up in the pod spec",
                          "remove user:password@ from it")
    host = parsed.hostname or ""
    if host in ("localhost", "::1") or host.startswith("127."):
        raise ConfigError("k8s_mlflow_tracking_uri", f"{uri!r} is a loopback address, which inside a pod is the pod itself",
                          "use the MLflow server's address as the pods see it (a Service name or an ingress)")
    return uri


def _quantity(field: str, value: str):
    from kubernetes.utils import parse_quantity

    try:
        return parse_quantity(value)
    except ValueError:
        raise ConfigError(field, f"{value!r} is not a Kubernetes quantity", "write e.g. 4, 500m or 16Gi") from None


def check_params(params: dict[str, Any], *, worker_tracking_uri: str | None) -> int:
    """Every rule of the kubernetes backend; returns the largest world size the run may have."""
    for name, spec in specs(KubernetesParams).items():
        check_value(spec, params.get(name, spec.default))
    if not str(params["store_uri"]).startswith("s3://"):
        raise ConfigError("store_uri", f"{params['store_uri']!r} is not reachable from the pods",
                          "use an s3://bucket/prefix store that both the pods and the worker can reach")
    nmin, nmax = node_range(params)
    if nmin > nmax:
        raise ConfigError("k8s_min_nodes", f"{nmin} is more than k8s_nnodes={nmax}", f"use 0 or a value <= {nmax}")
    if nmin < nmax and int(params["max_restarts"]) == 0:
        # Going on with fewer pods is a restart of the rank group on the pods that are left (a pod
        # joining later is not). Without one, a lost pod fails every pod and the Job starts over.
        raise ConfigError("max_restarts", f"0 restarts cannot let the run go on with fewer than k8s_nnodes={nmax} "
                          f"pods (k8s_min_nodes={nmin}): each pod lost uses one restart of the pods that are left",
                          f"set max_restarts to the pod losses to survive (e.g. {nmax - nmin}), or k8s_min_nodes to 0")
    for req, lim in (("k8s_cpu_request", "k8s_cpu_limit"), ("k8s_memory_request", "k8s_memory_limit")):
        if _quantity(req, params[req]) > _quantity(lim, params[lim]):
            raise ConfigError(lim, f"{params[lim]} is below {req}={params[req]}", f"raise {lim} or lower {req}")
    if _quantity("k8s_shm_size", params["k8s_shm_size"]) > _quantity("k8s_memory_limit", params["k8s_memory_limit"]):
        raise ConfigError("k8s_shm_size", f"{params['k8s_shm_size']} is more than the memory limit "
                          f"{params['k8s_memory_limit']} it counts against", "lower k8s_shm_size")
    if ".." in str(params["k8s_dataset_path"]).split("/"):
        raise ConfigError("k8s_dataset_path", f"{params['k8s_dataset_path']!r} leaves {DATA_MOUNT}",
                          "name a folder under /data")
    for key in dict(params.get("k8s_nccl_env") or {}):
        if not re.match(NCCL_NAME, str(key)):
            raise ConfigError("k8s_nccl_env", f"{key!r} is not an NCCL_*/TORCH_NCCL_* setting",
                              "use names like NCCL_DEBUG")
    worker = urlparse(worker_tracking_uri or "")
    if worker.scheme in ("", "file", "sqlite"):
        raise ConfigError("backend", "the worker's MLFLOW_TRACKING_URI is a store on the worker's own disk, which the "
                          "pods cannot log into", "point the worker's MLFLOW_TRACKING_URI at the MLflow server the "
                          "pods use")
    pod_tracking_uri(params, worker_tracking_uri)
    sizes = world_sizes(params)
    for ws in sizes:  # the trainer's own rules (batch size divisible by the world size...)
        pod_train_config(params, run_dir=f"{CHECKPOINT_MOUNT}/check", run_id="check", world_size=ws)
    return sizes[-1]
