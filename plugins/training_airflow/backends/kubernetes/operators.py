"""The Kubernetes backend's operators: the cncf-kubernetes provider's own, given their arguments
when the task runs (they depend on the run's Params and its MLflow run id, while Airflow creates
operators when it parses the DAG file), and the worker-side confirmation of the commit.
"""

from __future__ import annotations

import logging
import os
from functools import cached_property
from typing import Any

from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.operators.resource import (
    KubernetesCreateResourceOperator,
    KubernetesDeleteResourceOperator,
)
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from training_airflow.backends.kubernetes import watch
from training_airflow.backends.kubernetes.checks import pod_tracking_uri
from training_airflow.backends.kubernetes.spec import (
    CHECK_CONTAINER,
    EXIT_BAD_INPUT,
    JOB_STATIC_KWARGS,
    POD_STATIC_KWARGS,
    Names,
    in_store,
    job_operator_kwargs,
    job_wall_s,
    names,
    pod_train_config,
    service_yaml,
    upload_pod_kwargs,
)
from training_airflow.connections import store_env
from training_airflow.failures import fails_fast
from training_airflow.handoff import Handoff, Validated, committed
from training_airflow.mlflow_run import run_logger

log = logging.getLogger(__name__)


def committed_handoff(params: dict[str, Any], validated: Validated, *, job: dict[str, Any] | None) -> Handoff:
    """After the Job (checkpoints in the store: the ranks committed the final one) or the upload
    pod: read the commit back from the store (the worker has no checkpoint volume; the store
    settings are the run's, as on the local backend) and hand on the same keys as the local
    backend's ``upload_checkpoint``."""
    from training.checkpoint.commit import read_commit, run_location
    from training.store.base import StoreError

    run_id = validated["mlflow_run_id"]
    try:
        latest = read_commit(run_location(params["store_uri"], params["experiment"], run_id, store_env(params)))
    except StoreError as e:
        raise RuntimeError(f"training finished but {e}") from None
    return committed(validated, checkpoint_uri=latest["uri"], final_step=latest["step"], torchrun_wall_s=job_wall_s(job))


@fails_fast
def confirm_commit(params: dict[str, Any], validated: Validated, *, job: dict[str, Any] | None) -> Handoff:
    """The ``confirm_commit`` task: read the commit back, tag the MLflow run, hand on."""
    handoff = committed_handoff(params, validated, job=job)
    logger = run_logger(handoff["mlflow_run_id"])
    logger.set_tags({"checkpoint.uri": handoff["checkpoint_uri"]})
    # Same summary figure as the local backend; here it is the Job's start-to-completion time.
    logger.log_summary({"torchrun_wall_s": handoff["torchrun_wall_s"]})
    log.info("committed %s (step %d); Job wall time %.0fs", handoff["checkpoint_uri"], handoff["final_step"],
             handoff["torchrun_wall_s"])
    return handoff


def apply_kwargs(op: Any, kwargs: dict[str, Any]) -> None:
    """Set run-time arguments on an operator. Every key must already be an attribute that the
    operator's __init__ stores as given (a test builds the same objects both ways)."""
    for key, value in kwargs.items():
        if not hasattr(op, key):
            raise AttributeError(f"{type(op).__name__} has no argument {key!r}")
        setattr(op, key, value)


class _RunBound:
    """Mixin: the operator takes this run's `validate_data` handoff (an XComArg, so also the
    upstream dependency) and computes its Kubernetes arguments when the task runs (``prepare``,
    the first thing ``execute`` does; a test calls it alone to get the objects the task would
    send). Values are set after template rendering, so a Param value is never evaluated as a Jinja
    template."""

    handoff: Any

    def _run_id(self, context: Any) -> str:
        return self.handoff["mlflow_run_id"]

    def _names(self, context: Any) -> Names:
        return names(context["params"], mlflow_run_id=self._run_id(context), try_number=context["ti"].try_number)

    def _provider_execute(self, context: Any, error: type, status: int, fine: str) -> None:
        """The provider's own execute; an API answer of ``status`` only (409 exists, 404 gone) is fine."""
        try:
            super().execute(context)  # type: ignore[misc]  # the provider's operator, next in the MRO
        except error as e:
            if not all(getattr(x, "status", None) == status for x in e.api_exceptions):
                raise
            log.info("%s", fine)



class _ServiceBound(_RunBound):
    """The rendezvous Service's create and delete operators: the same manifest."""

    def prepare(self, context: Any) -> Names:
        names_ = self._names(context)
        apply_kwargs(self, {"yaml_conf": service_yaml(names_), "kubernetes_conn_id": context["params"]["kubernetes_conn_id"],
                            "_namespace": names_.namespace})
        return names_


class RendezvousServiceOperator(_ServiceBound, KubernetesCreateResourceOperator):
    """Create this run's headless Service (a retry finds it already there and goes on)."""

    template_fields = (*KubernetesCreateResourceOperator.template_fields, "handoff")

    def __init__(self, *, handoff: Any, **kwargs: Any) -> None:
        super().__init__(yaml_conf="# set when the task runs", **kwargs)
        self.handoff = handoff

    def execute(self, context: Any) -> dict[str, str]:
        from kubernetes.utils import FailToCreateError

        names_ = self.prepare(context)
        self._provider_execute(context, FailToCreateError, 409,
                               f"Service {names_.namespace}/{names_.service} already exists (a retried task): reusing it")
        # Read it back. The provider retries a failed create with the generator of YAML documents
        # its first attempt consumed, so a retried transient error ends in "Resource was created"
        # with nothing created; this read turns that into a failure (and an Airflow retry).
        from kubernetes.client.rest import ApiException

        try:
            svc = self.hook.core_v1_client.read_namespaced_service(name=names_.service, namespace=names_.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            raise RuntimeError(f"Service {names_.namespace}/{names_.service} was not created although the create "
                               "call returned; the task retry creates it") from None
        if svc.spec.cluster_ip != "None":
            raise RuntimeError(f"Service {names_.namespace}/{names_.service} exists but is not headless")
        return {"service": names_.service, "namespace": names_.namespace}


class DeleteRendezvousServiceOperator(_ServiceBound, KubernetesDeleteResourceOperator):
    """Delete this run's headless Service; one that is already gone is fine."""

    template_fields = (*KubernetesDeleteResourceOperator.template_fields, "handoff")

    def __init__(self, *, handoff: Any, **kwargs: Any) -> None:
        super().__init__(yaml_conf="# set when the task runs", **kwargs)
        self.handoff = handoff

    def execute(self, context: Any) -> None:
        from airflow.providers.cncf.kubernetes.utils.delete_from import FailToDeleteError

        names_ = self.prepare(context)
        self._provider_execute(context, FailToDeleteError, 404,
                               f"Service {names_.namespace}/{names_.service} does not exist (never created or already deleted)")


class TrainingJobOperator(_RunBound, KubernetesJobOperator):
    """The Indexed training Job. A Job failed by the podFailurePolicy (bad input) fails the task
    without Airflow retries: a retry would fail the same way. So do pods that cannot start (no node
    matches, the image cannot be pulled) once ``k8s_startup_timeout_s`` has passed: the Job is
    deleted and the task fails naming the cause, instead of waiting for the Job's deadline. A Job
    that failed otherwise fails the task with what its failed pods said (watch.failure)."""

    template_fields = (*KubernetesJobOperator.template_fields, "handoff")

    def __init__(self, *, handoff: Any, **kwargs: Any) -> None:
        super().__init__(**{**JOB_STATIC_KWARGS, **kwargs})
        self.handoff = handoff
        self.startup_timeout_s = 300.0  # k8s_startup_timeout_s, set when the task runs

    @cached_property
    def hook(self) -> watch.WatchedHook:
        return watch.WatchedHook(conn_id=self.kubernetes_conn_id, in_cluster=self.in_cluster, config_file=self.config_file,
                           cluster_context=self.cluster_context,
                           check=lambda pods: watch.stuck(pods, timeout_s=self.startup_timeout_s))

    def prepare(self, context: Any) -> Names:
        params = context["params"]
        names_ = self._names(context)
        tracking_uri = pod_tracking_uri(params, os.environ.get("MLFLOW_TRACKING_URI"))
        cfg = pod_train_config(params, run_dir=names_.run_dir, run_id=self._run_id(context),
                               token_shards=self.handoff.get("token_shards", ""))
        apply_kwargs(self, job_operator_kwargs(params, names_, mlflow_run_id=self._run_id(context),
                                               tracking_uri=tracking_uri, train_config=cfg,
                                               dag_run_id=str(context.get("run_id") or "")))
        self.startup_timeout_s = float(params["k8s_startup_timeout_s"])
        return names_

    @fails_fast
    def execute(self, context: Any):
        names_ = self.prepare(context)
        log.info("Indexed Job %s/%s: %s pods, rendezvous %s", names_.namespace, names_.job,
                 context["params"]["k8s_nnodes"], names_.rdzv_endpoint)
        try:
            return super().execute(context)
        except watch.PodsCannotStart as e:
            self.hook.batch_v1_client.delete_namespaced_job(names_.job, names_.namespace,
                                                            propagation_policy="Foreground")
            raise AirflowFailException(f"Job {names_.job} deleted: {e}; retrying would wait the same way") from None
        except Exception:
            reason = self.hook.is_job_failed(job=self.job) if self.job is not None and self.job.status else False
            if reason == "PodFailurePolicy":
                raise AirflowFailException(
                    f"Job {names_.job} failed by its podFailurePolicy: a container exited with code {EXIT_BAD_INPUT} "
                    f"(bad input). Read the '{CHECK_CONTAINER}' container log of the failed pod "
                    f"(kubectl -n {names_.namespace} logs -l job-name={names_.job} -c {CHECK_CONTAINER}), "
                    "fix the Params and trigger a new run; retrying would fail the same way") from None
            if reason:
                said = watch.failure(self.hook.job_pods(names_.job, names_.namespace))
                raise RuntimeError(f"Job {names_.job} failed ({reason}): {said}") from None
            raise


class UploadPodOperator(_RunBound, KubernetesPodOperator):
    """`python -m training upload` in a pod that mounts the checkpoint volume read-only; skipped
    when the ranks committed their checkpoints to the store themselves (checkpoint_location=store)."""

    template_fields = (*KubernetesPodOperator.template_fields, "handoff")

    def __init__(self, *, handoff: Any, **kwargs: Any) -> None:
        super().__init__(**{**POD_STATIC_KWARGS, **kwargs})
        self.handoff = handoff

    def prepare(self, context: Any) -> Names:
        names_ = self._names(context)
        apply_kwargs(self, upload_pod_kwargs(context["params"], names_, mlflow_run_id=self._run_id(context)))
        return names_

    def execute(self, context: Any):
        if in_store(context["params"]):
            raise AirflowSkipException("checkpoint_location=store: the ranks committed the final checkpoint to the "
                                       "store themselves; no upload pod (confirm_commit reads it back)")
        self.prepare(context)
        return super().execute(context)
