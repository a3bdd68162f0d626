"""deploy/helm/airflow-values.yaml (Airflow's official Helm chart) against what the rest of the
project says, without the chart or a cluster: the DAGs' environment is the compose stack's Airflow
environment (less what only compose needs, plus what a cluster adds), no credential is inlined,
the image is the one `make images` builds, the worker's service account and namespace are the ones
deploy/kubernetes/rbac.yaml grants, the Kubernetes-typed values pass the strict schemas, and the
Prometheus Operator objects match the alert rules and the chart's StatsD Service. The key paths
themselves were checked by hand against the chart's values.schema.json (the version in the values
file's header): the chart is not in the repository and no network is reached here."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "deploy" / "helm" / "airflow-values.yaml"
SERVICE_MONITOR = ROOT / "deploy" / "helm" / "statsd-servicemonitor.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
K8S_VERSIONS = ["1.30.0", f"{kubernetes_validate.latest_version()}.0"]

# Set in the compose stack, made by the chart from a value of ours (the value's path).
CHART_MAKES = {
    "AIRFLOW__CORE__EXECUTOR": ("executor",),
    "AIRFLOW__CORE__FERNET_KEY": ("fernetKeySecretName",),
    "AIRFLOW__API_AUTH__JWT_SECRET": ("jwtSecretName",),
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": ("data", "metadataSecretName"),
    # http://<release>-api-server:8080/execution/, with base_url's path
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": ("config", "api", "base_url"),
    # Celery's broker: the chart's Redis; its result backend: the metadata DB's connection
    "AIRFLOW__CELERY__BROKER_URL": ("redis", "enabled"),
    "AIRFLOW__CELERY__RESULT_BACKEND": ("data", "metadataSecretName"),
    # [metrics] statsd_*: to the chart's statsd exporter
    "AIRFLOW__METRICS__STATSD_ON": ("statsd", "enabled"),
    "AIRFLOW__METRICS__STATSD_HOST": ("statsd", "enabled"),
    "AIRFLOW__METRICS__STATSD_PORT": ("statsd", "enabled"),
    "AIRFLOW__METRICS__STATSD_PREFIX": ("statsd", "enabled"),
}
# Set in the compose stack only, and why the chart needs none of them.
COMPOSE_ONLY = {
    "AIRFLOW__CORE__AUTH_MANAGER": "the chart keeps FAB's auth manager; people are made with `airflow users create`",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "the simple auth manager is the compose stack's",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": "the simple auth manager is the compose stack's",
    "AIRFLOW_ADMIN_PASSWORD": "airflow-init writes the simple auth manager's password file from it",
    "AIRFLOW_TRAINER_PASSWORD": "airflow-init writes the simple auth manager's password file from it",
    "AIRFLOW_READER_PASSWORD": "airflow-init writes the simple auth manager's password file from it",
    "DUMB_INIT_SETSID": "the compose worker's warm shutdown; the chart's worker sets its own",
    "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "compose's healthcheck curls it; the chart's probes run `airflow jobs check`",
}
# Set by the values only: what a cluster adds.
CLUSTER_ONLY = {
    "TRAINING_BACKENDS": "the kubernetes backend is what a cluster is for",
    "TRAINING_MAX_ACTIVE_RUNS": "sized to the workers",
    "TRAINING_POLICY": "a shared deployment bounds what a trigger may ask",
    "AIRFLOW_CONN_KUBERNETES_DEFAULT": "the kubernetes backend's connection: the worker's service account",
}
MLFLOW_SECRET_KEYS = {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}  # a runtime's mlflow_secret (policy.py)
# Chart values that would put a credential into the release (the chart's names).
INLINE_SECRET_KEYS = [("fernetKey",), ("jwtSecret",), ("apiSecretKey",), ("webserverSecretKey",),
                      ("data", "metadataConnection"), ("data", "resultBackendConnection"), ("data", "brokerUrl"),
                      ("redis", "password"), ("createUserJob", "defaultUser"), ("webserver", "defaultUser"),
                      ("postgresql", "auth")]
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|_KEY$|CREDENTIAL", re.I)
SECRET_LIKE = [re.compile(r"://[^/@\s:]+:[^/@\s]+@"),  # user:password@ in a URL
               re.compile(r"^(AKIA|ASIA)[A-Z0-9]{12,}$"),  # an AWS access key id
               re.compile(r"^[A-Za-z0-9+/_=-]{32,}$")]  # a key-shaped blob (fernet, JWT secret, hex token)


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def get(tree: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def env_from(values: dict) -> list[dict]:
    return yaml.safe_load(values.get("extraEnvFrom") or "[]")


def compose_airflow_env() -> dict[str, object]:
    """Every variable the compose stack gives an Airflow service (airflow-*), by name."""
    stack = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())  # merge keys (<<:) resolved
    names: dict[str, object] = {}
    for name, svc in stack["services"].items():
        if not name.startswith("airflow-"):
            continue
        env = svc.get("environment") or {}
        pairs = env.items() if isinstance(env, dict) else (e.split("=", 1) + [None] for e in env)
        names.update({k: v for k, v, *_ in pairs})
    assert names, "no Airflow service in docker-compose.yaml"
    return names


def provided_env(values: dict) -> set[str]:
    """The variables the values put into the Airflow containers."""
    names = {e["name"] for e in values.get("env") or []} | {s["envName"] for s in values.get("secret") or []}
    names |= {e["name"] for e in yaml.safe_load(values.get("extraEnv") or "[]")}
    names |= {f"AIRFLOW__{section.upper()}__{key.upper()}" for section, keys in (values.get("config") or {}).items()
              for key in keys}
    for ref in env_from(values):
        secret = ref.get("secretRef", {}).get("name")
        names |= secret_keys(secret)
    return names


def secret_keys(secret: str | None) -> set[str]:
    from training_airflow.backends.kubernetes import spec
    from training_airflow.backends.kubernetes.params import KubernetesParams
    from training.config.fields import specs

    known = {specs(KubernetesParams)["k8s_s3_secret"].default: set(spec.S3_ENV), "training-mlflow": MLFLOW_SECRET_KEYS}
    assert secret in known, f"extraEnvFrom names the Secret {secret!r}: say here which variables it holds"
    return known[secret]


# --------------------------------------------------------------------------- environment


def test_the_values_give_the_airflow_containers_the_compose_stacks_environment(values):
    compose = set(compose_airflow_env())
    stale = (set(COMPOSE_ONLY) | set(CHART_MAKES)) - compose
    assert not stale, f"no longer in docker-compose.yaml: {stale}"
    assert not set(CLUSTER_ONLY) & compose, "set by compose too: not cluster-only"
    expected = (compose - set(COMPOSE_ONLY) - set(CHART_MAKES)) | set(CLUSTER_ONLY)
    got = provided_env(values)
    assert got == expected, (f"missing from the values: {sorted(expected - got)}; "
                             f"not in the compose stack nor CLUSTER_ONLY: {sorted(got - expected)}")
    for name, path in CHART_MAKES.items():
        assert get(values, path), f"{name}: the chart makes it from {'.'.join(path)}, which the values leave unset"


def test_every_training_variable_the_values_set_is_read_by_the_project(values):
    """A misspelt name would be set and ignored."""
    code = "\n".join(p.read_text() for d in ("plugins", "dags", "training") for p in (ROOT / d).rglob("*.py"))
    for name in provided_env(values):
        if name.startswith(("TRAINING_", "MLFLOW_")):
            assert re.search(rf"[\"']{name}[\"']", code), f"{name} is set but nothing in plugins/, dags/ or training/ reads it"


def test_the_training_settings_are_valid_where_the_dags_read_them(values, monkeypatch):
    from training_airflow import policy, settings

    env = {e["name"]: e["value"] for e in values["env"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert settings.training_schedule() == env["TRAINING_SCHEDULE"]
    assert "kubernetes" in settings.enabled_backends()
    assert settings.max_active_runs() >= 1
    assert env["MLFLOW_TRACKING_URI"].startswith(("http://", "https://")), "the kubernetes backend needs an MLflow server"
    # The policy file is where a volume of every Airflow container puts it.
    mounts = {m["mountPath"]: m["name"] for m in values["volumeMounts"]}
    volumes = {v["name"]: v for v in values["volumes"]}
    folder = str(Path(env[policy.ENV]).parent)
    assert folder in mounts and "configMap" in volumes[mounts[folder]], f"{policy.ENV} points outside the mounted ConfigMap"


def test_the_kubernetes_connection_is_the_workers_own_service_account(values):
    from training.config.fields import specs
    from training_airflow.backends.kubernetes.params import KubernetesParams

    conn_id = specs(KubernetesParams)["kubernetes_conn_id"].default
    env = {e["name"]: e["value"] for e in values["env"]}
    conn = json.loads(env[f"AIRFLOW_CONN_{conn_id.upper()}"])
    assert conn == {"conn_type": "kubernetes", "extra": {"in_cluster": True}}


# --------------------------------------------------------------------------- credentials


def inlined_secrets(values: dict) -> list[str]:
    """Where the values hold a credential instead of naming a Secret."""
    found = [".".join(path) for path in INLINE_SECRET_KEYS if get(values, path) not in (None, {}, "")]
    found += [f"env {e['name']}" for e in values.get("env") or [] if SECRET_NAME.search(e["name"])]

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        elif isinstance(node, str) and any(p.search(node) for p in SECRET_LIKE):
            found.append(path)

    walk(values, "")
    return found


def test_no_credential_is_in_the_values_only_secret_names(values):
    assert inlined_secrets(values) == []
    for path in [("fernetKeySecretName",), ("apiSecretKeySecretName",), ("jwtSecretName",), ("data", "metadataSecretName")]:
        assert get(values, path), f"{'.'.join(path)}: without it the chart generates or inlines the secret"
    assert values["createUserJob"]["enabled"] is False, "the chart's user job takes the password from the values"
    assert all(set(ref) == {"secretRef"} for ref in env_from(values)), "extraEnvFrom: Secrets only"


def test_the_credential_check_finds_an_inlined_one(values):
    bad = copy.deepcopy(values)
    bad["fernetKey"] = "8xQ2vJZ3n1pWmK4rT7yU0sB5cD9eF6gH2iL3oN8qR0s="
    bad["env"] += [{"name": "AWS_SECRET_ACCESS_KEY", "value": "x"},
                   {"name": "MLFLOW_TRACKING_URI", "value": "http://alice:hunter2@mlflow:5000"}]
    found = inlined_secrets(bad)
    assert "fernetKey" in found and "env AWS_SECRET_ACCESS_KEY" in found
    assert any(f.startswith("env[") for f in found), found  # the URL with a password


def test_the_workers_read_the_pods_s3_secret(values):
    """The worker commits, confirms and evaluates against the store the pods write: one Secret name
    and the same keys in both namespaces."""
    from training.config.fields import specs
    from training_airflow.backends.kubernetes.params import KubernetesParams

    names = [ref["secretRef"]["name"] for ref in env_from(values)]
    assert specs(KubernetesParams)["k8s_s3_secret"].default in names
    optional = {ref["secretRef"]["name"]: ref["secretRef"].get("optional", False) for ref in env_from(values)}
    assert optional == {"training-s3": False, "training-mlflow": True}


# --------------------------------------------------------------------------- image, accounts, schemas


def test_the_image_is_the_one_make_images_builds(values):
    from scripts.images import AIRFLOW_IMAGE

    name = AIRFLOW_IMAGE.rsplit("/", 1)[1].split(":")[0]
    image = values["images"]["airflow"]
    assert image["repository"].rsplit("/", 1)[1] == name
    assert image["tag"] and image["tag"] != "latest", "pin a tag: with IfNotPresent, latest is whatever a node cached"
    from_line = re.search(r"^FROM apache/airflow:(\S+?)-python", (ROOT / "docker" / "airflow.Dockerfile").read_text(), re.M)
    assert values["airflowVersion"] == from_line.group(1)
    docs = OPERATIONS.read_text()
    assert f"docker tag {AIRFLOW_IMAGE} {image['repository']}:{image['tag']}" in docs, "the docs push another tag"


def rbac_subject() -> dict:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "rbac.yaml").read_text()))
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (subject,) = binding["subjects"]
    return subject


def helm_commands(text: str) -> list[dict]:
    cmds = re.findall(r"helm upgrade --install (\S+) apache-airflow/airflow --version (\S+)\s*\\?\s*#?\s*--namespace (\S+)", text)
    return [{"release": r, "version": v, "namespace": n} for r, v, n in cmds]


def test_the_workers_run_as_the_account_rbac_yaml_grants(values):
    subject = rbac_subject()
    assert values["workers"]["celery"]["serviceAccount"] == {"create": True, "name": subject["name"]}
    assert values["workers"]["kubernetes"]["serviceAccount"] == {"create": True, "name": subject["name"]}
    commands = helm_commands(VALUES.read_text()) + helm_commands(OPERATIONS.read_text())
    assert len(commands) >= 2, "the values' header and docs/operations.md each show the helm command"
    assert {c["namespace"] for c in commands} == {subject["namespace"]}
    assert len({c["version"] for c in commands}) == 1, "one chart version: the one the values were checked against"
    (monitor,) = yaml.safe_load_all(SERVICE_MONITOR.read_text())
    assert monitor["metadata"]["namespace"] == subject["namespace"]
    assert {c["release"] for c in commands} == {monitor["spec"]["selector"]["matchLabels"]["release"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", ["celery", "kubernetes"])
def test_the_kubernetes_typed_values_pass_the_strict_schemas(values, kind, version):
    """What the chart copies into a worker pod (resources, volumes, env, envFrom), as one pod."""
    workers = values["workers"][kind]
    image = values["images"]["airflow"]
    container = {"name": "worker", "image": f"{image['repository']}:{image['tag']}",
                 "imagePullPolicy": image["pullPolicy"], "resources": workers["resources"],
                 "env": values["env"], "envFrom": env_from(values),
                 "volumeMounts": values["volumeMounts"] + workers["extraVolumeMounts"]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker", "namespace": rbac_subject()["namespace"]},
           "spec": {"serviceAccountName": workers["serviceAccount"]["name"], "containers": [container],
                    "volumes": values["volumes"] + workers["extraVolumes"],
                    "terminationGracePeriodSeconds": workers["terminationGracePeriodSeconds"]}}
    kubernetes_validate.validate(pod, version, strict=True)
    assert "/dev/shm" in {m["mountPath"] for m in workers["extraVolumeMounts"]}, "torchrun's ranks need /dev/shm"


# --------------------------------------------------------------------------- Prometheus Operator


def test_the_prometheusrule_holds_the_alert_rules():
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "training-alerts.yaml").read_text())
    (rule,) = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml").read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == rules["groups"], "deploy/kubernetes/prometheusrule.yaml and training-alerts.yaml differ"
    (monitor,) = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "podmonitor.yaml").read_text())
    assert rule["metadata"]["namespace"] == monitor["metadata"]["namespace"]


def test_the_statsd_servicemonitor_scrapes_the_charts_exporter(values):
    (monitor,) = yaml.safe_load_all(SERVICE_MONITOR.read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    # The labels and port name of the chart's <release>-statsd Service (templates/statsd/statsd-service.yaml).
    assert monitor["spec"]["selector"]["matchLabels"].keys() == {"tier", "component", "release"}
    assert monitor["spec"]["selector"]["matchLabels"]["component"] == "statsd"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["statsd-scrape"]
    assert values["statsd"]["enabled"] is True
