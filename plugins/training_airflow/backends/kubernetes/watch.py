"""Why the training Job does not get anywhere, read from its pods' status (pure: pods in, a
sentence out), and the hook that asks while it waits.

The provider's operator waits for the Job to finish. A Job whose pods can never start does not
finish until ``activeDeadlineSeconds`` (a day by default): a node selector no node matches keeps
its pods Pending, a missing image keeps them in ImagePullBackOff. ``stuck`` names such a cause
once it is certain (an invalid image name) or has lasted ``k8s_startup_timeout_s``. A pod that ran
and failed ends with the launcher's termination message (training/distributed/elastic.py: a
rendezvous that failed names the endpoint and the timeout); ``failure`` collects those when the
Job has failed.
"""

from __future__ import annotations

from datetime import datetime, timezone
from time import sleep
from typing import Any, Callable

from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

# The kubelet's reasons for a container that waits. The first never resolve by themselves; the
# others may (a registry that is down, a Secret created a moment later) and count after a timeout.
CERTAIN = {"InvalidImageName", "ErrImageNeverPull"}
STARTING = {"ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "CreateContainerError",
            "RunContainerError"}
FIX = {
    "image": "check k8s_image: is it pushed to a registry the nodes can pull from, with k8s_image_pull_secret "
             "if that registry is private?",
    "config": "a Secret or key the pod references is missing: create k8s_s3_secret in the namespace with "
              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "schedule": "no node has what the pod asks for: check k8s_node_selector against the nodes' labels "
                "(kubectl get nodes --show-labels) and the CPU, memory and GPU requests against what nodes have free",
}


class PodsCannotStart(Exception):
    """The Job's pods cannot start; the message names the cause and the fix."""


def _seconds(since: Any, now: datetime) -> float:
    if since is None:
        return 0.0
    if isinstance(since, str):
        since = datetime.fromisoformat(since.replace("Z", "+00:00"))
    return (now - since).total_seconds()


def _condition(pod: Any, kind: str) -> Any:
    return next((c for c in (pod.status.conditions or []) if c.type == kind), None)


def stuck(pods: list[Any], *, now: datetime | None = None, timeout_s: float) -> str | None:
    """A sentence naming why the pods cannot start, or None while they may still."""
    now = now or datetime.now(timezone.utc)
    for pod in pods:
        name, phase = pod.metadata.name, pod.status.phase
        if phase not in (None, "Pending"):
            continue
        scheduled = _condition(pod, "PodScheduled")
        if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
            waited = _seconds(scheduled.last_transition_time, now)
            if waited >= timeout_s:
                selector = dict(pod.spec.node_selector or {})
                return (f"pod {name} could not be scheduled for {waited:.0f}s (k8s_startup_timeout_s={timeout_s:.0f}): "
                        f"{scheduled.message}. Node selector {selector}; {FIX['schedule']}")
            continue
        statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
        for c in statuses:
            waiting = c.state.waiting if c.state else None
            if waiting is None or waiting.reason not in CERTAIN | STARTING:
                continue
            waited = _seconds(pod.status.start_time, now)
            if waiting.reason in CERTAIN or waited >= timeout_s:
                fix = FIX["config"] if waiting.reason.startswith("CreateContainerConfig") else FIX["image"]
                after = "" if waiting.reason in CERTAIN else f" for {waited:.0f}s (k8s_startup_timeout_s={timeout_s:.0f})"
                return (f"pod {name}: container {c.name} cannot start{after}: {waiting.reason}: {waiting.message} "
                        f"(image {c.image}); {fix}")
    return None


def failure(pods: list[Any]) -> str:
    """What the failed pods said when they ended (exit code and termination message), one line each."""
    lines = []
    for pod in pods:
        if pod.status.phase != "Failed":
            continue
        for c in [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]:
            ended = c.state.terminated if c.state else None
            if ended is not None and ended.exit_code:
                said = (ended.message or ended.reason or "").strip().splitlines()
                line = f"pod {pod.metadata.name} container {c.name} exited {ended.exit_code}"
                lines.append(f"{line}: {said[-1]}" if said else line)
    return "; ".join(dict.fromkeys(lines)) or "no failed pod left to read (deleted, or the Job hit its deadline)"


class WatchedHook(KubernetesHook):
    """The provider's hook, whose wait for the Job also reads the Job's pods at every poll and
    raises ``PodsCannotStart`` when ``check`` names a cause."""

    def __init__(self, *args: Any, check: Callable[[list[Any]], str | None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.check = check

    def job_pods(self, job_name: str, namespace: str) -> list[Any]:
        return self.core_v1_client.list_namespaced_pod(namespace, label_selector=f"job-name={job_name}").items

    def wait_until_job_complete(self, job_name: str, namespace: str, job_poll_interval: float = 10) -> Any:
        while True:
            job = self.get_job_status(job_name=job_name, namespace=namespace)
            if self.is_job_complete(job=job):
                return job
            cause = self.check(self.job_pods(job_name, namespace))
            if cause:
                raise PodsCannotStart(cause)
            self.log.info("Job %s is running; next look in %s s", job_name, job_poll_interval)
            sleep(job_poll_interval)
