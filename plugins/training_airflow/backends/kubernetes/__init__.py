"""The Kubernetes backend: the same ``python -m training`` entry points as N pods, through the
cncf-kubernetes provider's own operators (no scheduler of our own). docs/architecture.md
("Kubernetes backend") explains the objects; this package is split by concern:

- ``params.py``: its fields of the trigger form (declared once);
- ``spec.py``: pure spec building (names, Service, Indexed Job, upload pod; Params in, operator
  arguments out);
- ``checks.py``: the rules checked before anything exists on the cluster;
- ``operators.py``: the provider's operators, given their arguments when the task runs, and the
  worker-side confirmation of the commit.

Task group ``kubernetes``: ``create_rendezvous_service`` (setup) -> ``train_on_kubernetes`` (the
Indexed Job) -> ``upload_on_kubernetes`` (with ``checkpoint_location=local``, a pod commits the
final checkpoint from the PVC to the s3:// store; with ``store``, the ranks did, and it is
skipped) -> ``confirm_commit`` (the worker reads the commit back); ``delete_rendezvous_service``
is the teardown of the Service: it runs whatever happened to the Job once the Service was
created, and a failed teardown does not fail the DAG run.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from airflow.sdk import TaskGroup, TriggerRule, task

from training_airflow.backends.kubernetes.params import KubernetesParams

PARAMS = KubernetesParams
# checks and operators import the kubernetes client and the provider (about half a second): only
# where they are used, so that reading this backend's form fields (params.run_tags in every run's
# first task) stays cheap.


def check_params(params: dict[str, Any]) -> int:
    from training_airflow.backends.kubernetes import checks

    return checks.check_params(params, worker_tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))


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
