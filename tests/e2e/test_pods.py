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
import time

import boto3
import pytest
from mlflow.tracking import MlflowClient

from tests.e2e.pods import PlayedJob, PodsRun, pod_address
from training.tracking.run import summary_of

# What the local backend logs for the same run (docs/architecture.md, "Metrics (one schema)").
SCHEMA = {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s", "perf/step_s", "perf/data_wait_s",
          "perf/mfu", "comm/s_per_step", "comm/exposed_s_per_step", "comm/exposed_fraction", "comm/bytes_per_step",
          "comm/collectives_per_step", "eval/loss", "eval/accuracy", "mem/peak_bytes_max", "mem/peak_bytes_rank_0"}
# One-off figures: the run summary (summary.* tags), as on the local backend.
SUMMARY = {"goodput", "train_wall_s", "device_hours", "peak_mem_bytes_max", "state_bytes_per_rank", "torchrun_wall_s"}


@pytest.fixture
def pods_run(container_engine, training_image, tmp_path, dataset, s3_server, mlflow_server, monkeypatch):
    import mlflow

    runs = []
    tracking_uri = mlflow.get_tracking_uri()  # PodsRun points this process at the tracking server

    def make(**overrides) -> PodsRun:
        run = PodsRun(engine=container_engine, image=training_image, root=tmp_path, dataset=dataset,
                      s3_endpoint=s3_server["endpoint"], mlflow=mlflow_server, setenv=monkeypatch.setenv, **overrides)
        runs.append(run)
        return run

    try:
        yield make
    finally:
        mlflow.set_tracking_uri(tracking_uri)  # the later tests' store, as before
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
    """The default path: the ranks of both pods commit every checkpoint straight to the store (S3
    through the pods' Secret); no upload pod runs; the worker reads the commit back and evaluates."""
    from airflow.sdk.exceptions import AirflowSkipException

    from training_airflow import tasks
    from training_airflow.backends.kubernetes.operators import confirm_commit

    run = pods_run()
    assert run.params["checkpoint_location"] == "store"
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
    assert "train: mlp/ddp/fp32 on 2 ranks (ddp x2), backend=gloo" in log0, log0[-3000:]
    assert f"train: done at step {run.params['steps']}" in log0

    op = run.dag.task_dict["upload_on_kubernetes"]
    op.handoff = opened
    with pytest.raises(AirflowSkipException, match="the ranks committed the final checkpoint"):
        op.execute(run.context("upload_on_kubernetes"))
    assert not any(run.checkpoints.rglob("*.distcp")), "nothing was written to the checkpoint volume"

    handoff = confirm_commit(run.params, opened, job=played.status())
    assert handoff["final_step"] == run.params["steps"] and handoff["torchrun_wall_s"] > 0
    manifest = _final_manifest_matches(run.s3_endpoint, handoff["checkpoint_uri"])
    assert manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "model.safetensors"} <= {f["path"] for f in manifest["files"]}

    scored = tasks.evaluate(run.params, handoff)
    assert 0.6 <= scored["eval_accuracy"] <= 1.0

    client = MlflowClient()
    mlrun = client.get_run(opened["mlflow_run_id"])
    assert SCHEMA <= set(mlrun.data.metrics), sorted(SCHEMA - set(mlrun.data.metrics))
    assert SUMMARY <= set(summary_of(mlrun)), sorted(SUMMARY - set(summary_of(mlrun)))
    assert (mlrun.data.params["world_size"], mlrun.data.params["backend"]) == ("2", "gloo")
    loss = client.get_metric_history(opened["mlflow_run_id"], "train/loss")
    assert [h.step for h in loss] == list(range(10, run.params["steps"] + 1, 10)), "one point per log interval"


@pytest.mark.slow
def test_a_lost_pod_scales_the_run_down_and_it_finishes_on_one(pods_run):
    """--nnodes 1:2: pod 1's container is SIGKILLed mid-run and its node is gone (the replacement
    pod finds no room). Pod 0's agent restarts its ranks (max_restarts), re-rendezvouses alone
    and resumes from the latest complete checkpoint; the Job succeeds with pod 0 (successPolicy)."""
    # checkpoint_location=local: checkpoints and steps.jsonl on the volume, where the test watches them.
    run = pods_run(k8s_min_nodes=1, max_restarts=1, steps=100, checkpoint_every=20, checkpoint_location="local")
    run.validate()
    _, job = run.render()
    run.slow_steps(job, 100)
    played = PlayedJob(run.cluster, job)
    run.wait_for_step(played, 45)  # between checkpoints (every 20): the restart loses steps
    run.cluster.lost_nodes.add(1)
    killed_at = time.time()
    played.pods[1].signal("KILL")
    played.run(timeout_s=600)
    assert played.condition == ("Complete", "SuccessPolicy"), played.describe()
    assert [(i, code, action) for i, _, code, action in played.history] == [(1, 137, "Count")]
    assert played.pods[1].phase == "Pending" and played.pods[1].unschedulable

    log0 = played.pods[0].logs()
    assert "restart 1, resuming from" in log0 and "on 1 ranks" in log0, log0[-4000:]
    records = run.steps()
    resumed = next(r for r in records if r["restart"] == 1)
    assert resumed["step"] % 20 == 1, "the first step after the restart follows a checkpoint"
    mlrun = MlflowClient().get_run(run.opened["mlflow_run_id"])
    m, summary = mlrun.data.metrics, summary_of(mlrun)
    assert m["fault/restarts"] == 1 and m["fault/steps_lost"] >= 1 and 0 < m["fault/recovery_s"] < 60
    recovery = resumed["t"] - killed_at
    print(f"scale-down recovery: {recovery:.1f}s from SIGKILL to the first step on one pod; "
          f"fault/recovery_s {m['fault/recovery_s']:.1f}s; steps lost {m['fault/steps_lost']:.0f}")
    # Device-hours count each attempt's world size: 2 ranks until the kill, 1 after.
    wall = summary["train_wall_s"]
    assert wall / 3600 < summary["device_hours"] < 2 * wall / 3600


@pytest.mark.slow
def test_preemption_checkpoints_exits_75_and_the_job_resumes_without_counting_it(pods_run):
    """`podman stop -t <terminationGracePeriodSeconds>` on pod 1 is what a kubelet does to a
    preempted pod: SIGTERM to the launcher, SIGKILL after the grace. Each link: the ranks (of both
    pods) agree on a step and write its checkpoint, well inside the grace; each launcher exits 75;
    the Job's own podFailurePolicy Ignores 75 (backoffLimit 0: one counted failure would fail the
    Job); the replacement pods resume from that checkpoint and finish; the upload pod then commits the
    final checkpoint from the volume (checkpoint_location=local)."""
    run = pods_run(k8s_backoff_limit=0, steps=60, checkpoint_every=30, k8s_termination_grace_s=45,
                   checkpoint_location="local")
    run.validate()
    _, job = run.render()
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    run.slow_steps(job, 100)
    played = PlayedJob(run.cluster, job)
    run.wait_for_step(played, 20)
    stopping = time.monotonic()
    played.pods[1].stop(grace)
    took = time.monotonic() - stopping
    first = dict(played.pods)
    played.run(timeout_s=600)

    assert played.condition[0] == "Complete", f"{played.describe()}\n{first[1].logs()[-20000:]}"
    assert took < grace, f"the pod needed {took:.1f}s of its {grace}s grace"
    assert sorted((i, code, action) for i, _, code, action in played.history) == [(0, 75, "Ignore"), (1, 75, "Ignore")]
    assert played.failed == 0
    for pod in first.values():
        assert pod.messages["base"].startswith("elastic: preempted: the ranks agreed on a step"), pod.messages
    stopped = [p.name for p in (run.run_dir() / "checkpoints").iterdir() if (p / "manifest.json").exists()
               and int(p.name[5:]) not in (30, 60)]
    assert len(stopped) == 1, stopped
    step = int(stopped[0][5:])
    assert 20 <= step < 60
    assert f"train: preempted; checkpoint written at step {step}" in first[0].logs()
    resumed = played.pods[0].logs()
    assert "restart 0, resuming from" in resumed and f"(step {step})" in resumed, resumed[-3000:]
    assert f"train: done at step {run.params['steps']}" in resumed

    # checkpoint_location=local: the upload pod commits the final checkpoint from the volume.
    from training_airflow.backends.kubernetes.operators import confirm_commit

    upload = run.upload()
    assert upload.phase == "Succeeded", upload.logs()[-3000:]
    handoff = confirm_commit(run.params, run.opened, job=played.status())
    assert handoff["final_step"] == run.params["steps"]
    manifest = _final_manifest_matches(run.s3_endpoint, handoff["checkpoint_uri"])
    assert {"__0_0.distcp", "__1_0.distcp", "model.safetensors"} <= {f["path"] for f in manifest["files"]}


def _until_stuck(run: PodsRun, limit_s: float) -> tuple[str | None, float, PlayedJob]:
    """Start the rendered Job and ask, at every poll as the operator's wait does (watch.stuck),
    whether its pods cannot start; the cause, how long it took, and the Job."""
    from training_airflow.backends.kubernetes import watch

    run.validate()
    _, job = run.render()
    played = PlayedJob(run.cluster, job)
    start = time.monotonic()
    cause = None
    while cause is None and time.monotonic() - start < limit_s:
        played.step()
        cause = watch.stuck(played.v1pods(), timeout_s=run.params["k8s_startup_timeout_s"])
        time.sleep(1)
    return cause, time.monotonic() - start, played


@pytest.mark.slow
def test_a_missing_image_fails_in_the_startup_timeout_naming_the_image(pods_run):
    run = pods_run(k8s_image="localhost/distributed-training:missing", k8s_startup_timeout_s=10)
    cause, took, _ = _until_stuck(run, 120)
    assert cause and "localhost/distributed-training:missing" in cause and "k8s_image" in cause, cause
    assert "ImagePullBackOff" in cause or "ErrImagePull" in cause
    assert 10 <= took < 40, took


@pytest.mark.slow
def test_a_node_selector_nothing_matches_fails_in_the_startup_timeout_naming_it(pods_run):
    run = pods_run(k8s_node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, k8s_startup_timeout_s=10)
    cause, took, played = _until_stuck(run, 60)
    assert cause and "didn't match Pod's node affinity/selector" in cause and "NVIDIA-H100-80GB-HBM3" in cause, cause
    assert 10 <= took < 20, took
    assert all(p.started is None for p in played.pods.values()), "nothing ran"


@pytest.mark.slow
def test_a_rendezvous_port_taken_by_something_else_fails_in_the_rendezvous_timeout_naming_it(pods_run):
    """On pod 0's node the rendezvous port is held by a process that is not the c10d store (with
    hostNetwork: another service; without: a NetworkPolicy or a Service on another port behaves
    alike: nothing answers as the store would). Both pods fail after k8s_rdzv_timeout_s, each
    saying which endpoint it could not reach; the Job fails (backoffLimit 0) with their words."""
    import socket

    from training_airflow.backends.kubernetes import watch

    run = pods_run(k8s_rdzv_timeout_s=10, k8s_backoff_limit=0)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind((pod_address(0), run.params["k8s_rdzv_port"]))  # pod 0's store, which binds every address, cannot
    squatter.listen(16)  # accepts connections (the kernel does), never answers
    try:
        run.validate()
        _, job = run.render()
        played = PlayedJob(run.cluster, job)
        start = time.monotonic()
        played.run(timeout_s=180)
        took = time.monotonic() - start
    finally:
        squatter.close()
    assert played.condition == ("Failed", "BackoffLimitExceeded"), played.describe()
    said = watch.failure(played.v1pods())
    endpoint = f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}"
    # torch's store client waits for an answer without a limit; the launcher's watchdog ends it
    # after read + join + last-call timeouts (10 + 10 + 5 s) and 10 s more.
    assert f"the rendezvous with the rendezvous store at {endpoint}" in said and "within 35s" in said, said
    assert took < 90, took
