"""The Kubernetes backend: the same ``python -m training`` entry points as N pods, through the
cncf-kubernetes provider's own operators (no scheduler of our own). Modules: ``params`` (its fields
of the trigger form), ``spec`` (pure spec building: Params in, operator arguments out), ``checks``
(rules checked before anything exists on the cluster), ``watch`` (why a Job does not get anywhere),
``operators`` (the provider's operators, given their arguments when the task runs, and the
worker-side confirmation of the commit). docs/architecture.md ("Kubernetes backend") explains the objects.

Task group ``kubernetes``: ``create_rendezvous_service`` (setup) -> ``train_on_kubernetes`` (the
Indexed Job) -> ``upload_on_kubernetes`` (a pod commits the final checkpoint from the PVC with
``checkpoint_location=local``; skipped with ``store``) -> ``confirm_commit`` (the worker reads the
commit back); ``delete_rendezvous_service`` is the teardown: it runs whatever happened to the Job
once the Service exists, and a failed teardown does not fail the DAG run.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from airflow.sdk import TaskGroup, TriggerRule, task

from training_airflow.backends.kubernetes.params import KubernetesParams

PARAMS = KubernetesParams
# checks and operators import the kubernetes client and the provider (slow: docs/benchmarks.md): only
# where they are used, so that reading this backend's form fields (training_airflow.params.run_tags
# in every run's first task) stays cheap.


def check_params(params: dict[str, Any]) -> int:
    from training_airflow.backends.kubernetes import checks

    return checks.check_params(params, worker_tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))


def memory_budget(params: dict[str, Any]) -> tuple[Any, int]:
    """A CPU pod's memory limit (``k8s_memory_limit``, set in the Job's resources) less the torchrun
    agent, split between its ranks, on the fewest pods the run may have; GPU pods: the ranks check
    their device's free memory themselves."""
    from kubernetes.utils import parse_quantity

    from training.metrics.preflight import pod_budget
    from training_airflow.backends.kubernetes.spec import procs_per_node, world_sizes

    world = world_sizes(params)[0]
    if int(params["k8s_gpus_per_node"]):
        return None, world
    return pod_budget(int(parse_quantity(params["k8s_memory_limit"])), procs_per_node(params)), world


def train_and_commit(validated: Any) -> Any:
    """Task group ``kubernetes``; returns the XComArg of the Handoff."""
    from training_airflow.backends.kubernetes.operators import (
        DeleteRendezvousServiceOperator,
        RendezvousServiceOperator,
        TrainingJobOperator,
        UploadPodOperator,
        confirm_commit,
    )

    with TaskGroup("kubernetes", prefix_group_id=False,
                   tooltip="Indexed Job of k8s_nnodes pods, an upload pod, the rendezvous Service around them"):
        create = RendezvousServiceOperator(task_id="create_rendezvous_service", handoff=validated)
        job = TrainingJobOperator(task_id="train_on_kubernetes", handoff=validated,
                                  # the Job's activeDeadlineSeconds (Param k8s_active_deadline_s) is the real limit
                                  execution_timeout=timedelta(days=30))
        upload = UploadPodOperator(task_id="upload_on_kubernetes", handoff=validated)
        delete = DeleteRendezvousServiceOperator(task_id="delete_rendezvous_service", handoff=validated)

        @task(task_id="confirm_commit", trigger_rule=TriggerRule.NONE_FAILED)  # runs after a skipped upload too
        def confirm(validated: dict, params=None, ti=None) -> dict:
            return confirm_commit(params, validated, job=ti.xcom_pull(task_ids="train_on_kubernetes", key="job"))

        confirmed = confirm(validated)
        create >> job >> upload >> confirmed
        job >> delete.as_teardown(setups=create)
        return confirmed
