"""The deployment's policy: what a trigger may ask, set by the platform in one YAML file
(``TRAINING_POLICY``), never by the form. Runtimes (image, namespace, service account, Secrets,
node placement, resource ceilings) a trigger picks by name, ceilings for every run, the module
prefixes a ``model=`` factory may come from, and the URI prefixes of data and stores.

``load`` reads and validates the file (errors name the file and the key); ``check`` refuses a
run's Params outside it (``PolicyError``: the rule, the value, what is allowed) and is called
before any user code is imported: by the api-server's middleware (conf_check.py) and by
``open_run``. No file: ``PERMISSIVE``, which allows everything (the laptop, ``make demo``).
Reference: docs/operations.md. Light imports only: the plugin loads this in every Airflow process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from training.config.fields import ConfigError

ENV = "TRAINING_POLICY"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class PolicyFileError(ValueError):
    """The policy file cannot be read or breaks the schema; the message names the file and the key."""


class PolicyError(ConfigError):
    """A run's Params ask for something the deployment's policy does not allow."""

    def __init__(self, field_name: str, rule: str, value: Any, allowed: str):
        self.rule = rule
        super().__init__(field_name, f"{value!r} is refused by the deployment policy (rule {rule})",
                         f"use {allowed}, or ask the platform team to change the policy")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _quantity(value: str) -> Any:
    from kubernetes.utils import parse_quantity  # the Kubernetes client's own parser

    return parse_quantity(value)


class Ceilings(_Strict):
    """Upper bounds of one run (absent: no bound)."""

    nodes: int | None = Field(None, ge=1, description="pods of a Kubernetes run (k8s_nnodes)")
    ranks: int | None = Field(None, ge=1, description="training processes: world_size, or pods x GPUs per pod")
    gpus: int | None = Field(None, ge=0, description="GPUs of a run over all its pods")
    gpus_per_node: int | None = Field(None, ge=0, description="GPUs per pod (k8s_gpus_per_node)")
    cpu_per_pod: str | None = Field(None, description="Kubernetes quantity: k8s_cpu_limit at most this")
    memory_per_pod: str | None = Field(None, description="Kubernetes quantity: k8s_memory_limit at most this")
    steps: int | None = Field(None, ge=1, description="optimizer steps (steps)")
    wall_clock_s: int | None = Field(None, ge=60, description="seconds a DAG run may take (dagrun_timeout; "
                                     "k8s_active_deadline_s at most this)")

    @field_validator("cpu_per_pod", "memory_per_pod")
    @classmethod
    def _is_quantity(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                _quantity(v)
            except ValueError:
                raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)") from None
        return v

    def tighter(self, other: "Ceilings") -> "Ceilings":
        """The smaller of each bound of ``self`` and ``other``."""
        merged: dict[str, Any] = {}
        for name in type(self).model_fields:
            a, b = getattr(self, name), getattr(other, name)
            if a is None or b is None:
                merged[name] = b if a is None else a
            elif name in ("cpu_per_pod", "memory_per_pod"):
                merged[name] = a if _quantity(a) <= _quantity(b) else b
            else:
                merged[name] = min(a, b)
        return Ceilings(**merged)


class Toleration(_Strict):
    """A Kubernetes toleration as a pod spec writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")


class Runtime(_Strict):
    """A named place to run, defined by the platform; a trigger picks one (the Param ``runtime``)."""

    description: str = ""
    backend: Literal["local", "kubernetes"] | None = Field(None, description="the only backend it runs on")
    images: list[str] = Field(default_factory=list, description="k8s_image: a registry prefix ending in '/', a "
                              "digest sha256:<64 hex>, or a full reference name@sha256:<64 hex>; empty: any")
    namespaces: list[str] = Field(default_factory=list, description="k8s_namespace one of these; empty: any")
    service_account: str | None = Field(None, description="the pods' service account")
    image_pull_secret: str | None = Field(None, description="the pods' pull Secret; k8s_image_pull_secret empty "
                                          "or this")
    node_selector: dict[str, str] = Field(default_factory=dict, description="labels every pod gets; "
                                          "k8s_node_selector may add labels, not change these")
    tolerations: list[Toleration] = Field(default_factory=list, description="Kubernetes tolerations every "
                                              "training pod gets")
    s3_secret: str | None = Field(None, description="Secret the pods' S3 keys come from; replaces k8s_s3_secret")
    pvcs: list[str] = Field(default_factory=list, description="PersistentVolumeClaims k8s_data_pvc and "
                            "k8s_checkpoint_pvc may name; empty: any")
    mlflow_secret: str | None = Field(None, description="Secret with MLFLOW_TRACKING_USERNAME/PASSWORD the "
                                      "pods log to MLflow with")
    ceilings: Ceilings = Field(default_factory=Ceilings)

    @field_validator("images")
    @classmethod
    def _image_rules(cls, v: list[str]) -> list[str]:
        for entry in v:
            if not (_DIGEST.match(entry) or entry.endswith("/") or re.search(r"@sha256:[0-9a-f]{64}$", entry)):
                raise ValueError(f"{entry!r} is neither a registry prefix ending in '/' (a bare prefix such as "
                                 "'registry.example.com/ml' would also allow 'registry.example.com/ml-other/...'), "
                                 "a digest sha256:<64 hex> nor a reference name@sha256:<64 hex>")
        return v

    @field_validator("namespaces")
    @classmethod
    def _namespace_names(cls, v: list[str]) -> list[str]:
        for ns in v:
            if not _DNS_LABEL.match(ns):
                raise ValueError(f"{ns!r} is not a Kubernetes namespace name")
        return v


class Code(_Strict):
    """Where a model's code may come from (the built-in families are always allowed)."""

    model_prefixes: list[str] | None = Field(None, description="packages a model=package.module:function factory "
                                             "may come from (the module or a package above it); null: any")
    hf_roots: list[str] | None = Field(None, description="folders or s3:// prefixes an hf:<folder> model may come "
                                       "from; null: anywhere")

    @field_validator("model_prefixes")
    @classmethod
    def _dotted(cls, v: list[str] | None) -> list[str] | None:
        for p in v or []:
            if not _MODULE.match(p):
                raise ValueError(f"{p!r} is not a dotted module name such as 'team_models' or 'team_models.vision'")
        return v


class Data(_Strict):
    """URI prefixes (local folders, s3://bucket/prefix) each field may name; null: any. ``connections``:
    the Airflow connections ``aws_conn_id`` may name (null: any; empty: none, the worker's own keys)."""

    dataset_uri: list[str] | None = None
    store_uri: list[str] | None = None
    tokenizer: list[str] | None = None
    connections: list[str] | None = None

    @field_validator("dataset_uri", "store_uri", "tokenizer")
    @classmethod
    def _absolute(cls, v: list[str] | None) -> list[str] | None:
        for p in v or []:
            if not (p.startswith(("s3://", "file:///")) or p.startswith("/")):
                raise ValueError(f"{p!r} is neither an absolute folder, file:///folder nor s3://bucket[/prefix]")
        return v


class Sweeps(_Strict):
    """Bounds of one hyperparameter sweep (``training_sweep``; absent: no bound)."""

    trials: int | None = Field(None, ge=1, description="trials of one sweep")
    parallel_trials: int | None = Field(None, ge=1, description="trials of one sweep training at once")
    total_steps: int | None = Field(None, ge=1, description="optimizer steps of all a sweep's trials together "
                                    "(trials x steps)")


class Policy(_Strict):
    """The whole file."""

    runtimes: dict[str, Runtime] = Field(default_factory=lambda: {"default": Runtime()}, min_length=1)
    ceilings: Ceilings = Field(default_factory=Ceilings)
    code: Code = Field(default_factory=Code)
    data: Data = Field(default_factory=Data)
    sweeps: Sweeps = Field(default_factory=Sweeps)

    @field_validator("runtimes")
    @classmethod
    def _names(cls, v: dict[str, Runtime]) -> dict[str, Runtime]:
        for name in v:
            if not _DNS_LABEL.match(name):
                raise ValueError(f"runtime name {name!r} is not lower-case letters, digits and '-'")
        return v

    def ceilings_of(self, runtime: str) -> Ceilings:
        """The deployment's ceilings, tightened by the runtime's own."""
        return self.ceilings.tighter(self.runtimes[runtime].ceilings)

    def form_maximum(self, name: str, backend: str | None = None) -> int | None:
        """The largest value of a ceiling that any runtime (of ``backend``) allows: the form's
        ``maximum``; None: unbounded."""
        values = [getattr(self.ceilings_of(r), name) for r, rt in self.runtimes.items()
                  if backend is None or rt.backend in (None, backend)]
        return None if not values or any(v is None for v in values) else max(values)


@dataclass(frozen=True)
class Loaded:
    """A policy and where it came from: ``source`` (the file, or ``built-in``) and ``sha256`` (of
    the file's bytes: the version a run records)."""

    policy: Policy
    source: str
    sha256: str


PERMISSIVE = Loaded(Policy(), "built-in", hashlib.sha256(b"built-in permissive policy v1").hexdigest())


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse(text: str | bytes, source: str) -> Loaded:
    """A policy from YAML (the file's bytes, or text); ``PolicyFileError`` names ``source`` and the key."""
    import yaml

    data = text.encode() if isinstance(text, str) else text

    try:
        raw = yaml.safe_load(data)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise PolicyFileError(f"policy file {source}{at}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PolicyFileError(f"policy file {source}: the top level must be a mapping of runtimes, ceilings, code, "
                              "data")
    try:
        policy = Policy.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "is not a key of the policy (see docs/operations.md, 'Deployment policy')"
        raise PolicyFileError(f"policy file {source}: key {_where(first['loc'])}: {message}") from None
    return Loaded(policy, source, hashlib.sha256(data).hexdigest())


@functools.lru_cache(maxsize=8)
def _load_file(path: str, _mtime_ns: int, _size: int) -> Loaded:
    return parse(Path(path).read_bytes(), path)


def load(path: str | None = None) -> Loaded:
    """This deployment's policy: the file ``path`` or ``$TRAINING_POLICY``; none set: ``PERMISSIVE``."""
    path = path if path is not None else os.environ.get(ENV, "").strip()
    if not path:
        return PERMISSIVE
    try:
        st = Path(path).stat()
    except OSError as e:
        raise PolicyFileError(f"policy file {path} ({ENV}): cannot be read ({e.strerror})") from None
    return _load_file(path, st.st_mtime_ns, st.st_size)


# --------------------------------------------------------------------------- checking a run


def _under(value: str, prefixes: list[str]) -> bool:
    """Whether a URI or folder lies under one of ``prefixes`` (folders compared after resolving
    ``..``, s3:// prefixes at a '/' boundary)."""
    if value.startswith("s3://"):
        return any(value == p.rstrip("/") or value.startswith(p.rstrip("/") + "/") for p in prefixes
                   if p.startswith("s3://"))
    if "://" in value and not value.startswith("file://"):
        return False
    path = Path(os.path.normpath(value.removeprefix("file://")))
    return any(path.is_relative_to(os.path.normpath(p.removeprefix("file://"))) for p in prefixes
               if not p.startswith("s3://"))


def _listed(items: list[str]) -> str:
    return "one of " + ", ".join(repr(i) for i in items) if items else "nothing (the list is empty)"


def check(params: dict[str, Any], loaded: Loaded | None = None, *, resolve=lambda v: v) -> str:
    """Refuse ``params`` (a run's full Params, defaults included) outside the policy with a
    ``PolicyError``; return the runtime's name. ``resolve``: how a relative path becomes a folder
    (the worker's ``settings.resolve_path``). Reads nothing but the Params: no user code, no data."""
    loaded = loaded or load()
    policy = loaded.policy
    name = params.get("runtime") or next(iter(policy.runtimes))
    if name not in policy.runtimes:
        raise PolicyError("runtime", "runtimes", name, _listed(list(policy.runtimes)))
    rt = policy.runtimes[name]
    backend = params.get("backend", "local")
    if rt.backend is not None and backend != rt.backend:
        raise PolicyError("backend", f"runtimes.{name}.backend", backend, f"backend={rt.backend} with runtime {name}")
    _check_code(params, policy.code, resolve)
    _check_data(params, policy.data, resolve)
    ceilings = policy.ceilings_of(name)
    where = f"ceilings of runtime {name}"
    if ceilings.steps is not None and int(params.get("steps", 0)) > ceilings.steps:
        raise PolicyError("steps", f"{where}: steps", params["steps"], f"at most {ceilings.steps}")
    if backend == "kubernetes":
        _check_kubernetes(params, name, rt, ceilings)
    elif ceilings.ranks is not None and int(params.get("world_size", 1)) > ceilings.ranks:
        raise PolicyError("world_size", f"{where}: ranks", params["world_size"], f"at most {ceilings.ranks}")
    return name


def check_dataset(dataset_uri: str, loaded: Loaded | None = None, *, resolve=lambda v: v) -> None:
    """Refuse a dataset folder outside ``data.dataset_uri`` (register_dataset writes there)."""
    _check_data({"dataset_uri": dataset_uri}, (loaded or load()).policy.data, resolve)


def _check_code(params: dict[str, Any], code: Code, resolve) -> None:
    model = str(params.get("model", ""))
    if model.startswith("hf:"):
        folder = model.removeprefix("hf:")
        if code.hf_roots is not None and not _under(resolve(folder), code.hf_roots):
            raise PolicyError("model", "code.hf_roots", model, "an hf: folder under " + _listed(code.hf_roots))
    elif ":" in model and code.model_prefixes is not None:
        module = model.split(":", 1)[0]
        if not any(module == p or module.startswith(p + ".") for p in code.model_prefixes):
            raise PolicyError("model", "code.model_prefixes", model,
                              "a built-in family or a factory from a package under " + _listed(code.model_prefixes))


def _check_data(params: dict[str, Any], data: Data, resolve) -> None:
    for field in ("dataset_uri", "store_uri", "tokenizer"):
        allowed = getattr(data, field)
        value = params.get(field)
        if field == "tokenizer" and (not value or str(value) == "bytes" or str(value).startswith("bpe:")):
            continue  # made from the run's own data: no file is read
        if allowed is not None and value is not None and not _under(resolve(str(value)), allowed):
            raise PolicyError(field, f"data.{field}", value, "a URI under " + _listed(allowed))
    conn = params.get("aws_conn_id")
    if data.connections is not None and conn and conn not in data.connections:
        raise PolicyError("aws_conn_id", "data.connections", conn, "an empty value (the worker's own keys)" + (
            " or " + _listed(data.connections) if data.connections else ": this deployment lends no stored connection"))


def _check_kubernetes(params: dict[str, Any], name: str, rt: Runtime, ceilings: Ceilings) -> None:
    rule = f"runtimes.{name}"
    image = str(params.get("k8s_image", ""))
    if rt.images and not any(image.endswith("@" + e) if _DIGEST.match(e) else
                             (image.startswith(e) if e.endswith("/") else image == e) for e in rt.images):
        raise PolicyError("k8s_image", f"{rule}.images", image, "an image matching " + _listed(rt.images))
    if rt.namespaces and params.get("k8s_namespace") not in rt.namespaces:
        raise PolicyError("k8s_namespace", f"{rule}.namespaces", params.get("k8s_namespace"), _listed(rt.namespaces))
    pull = params.get("k8s_image_pull_secret")
    if rt.image_pull_secret is not None and pull and pull != rt.image_pull_secret:
        raise PolicyError("k8s_image_pull_secret", f"{rule}.image_pull_secret", pull,
                          f"an empty value or {rt.image_pull_secret!r} (the runtime's)")
    selector = dict(params.get("k8s_node_selector") or {})
    for key, value in rt.node_selector.items():
        if key in selector and selector[key] != value:
            raise PolicyError("k8s_node_selector", f"{rule}.node_selector", {key: selector[key]},
                              f"{key}={value!r} (the runtime's) or leaving {key} out")
    for field in ("k8s_data_pvc", "k8s_checkpoint_pvc"):
        if rt.pvcs and params.get(field) and params[field] not in rt.pvcs:
            raise PolicyError(field, f"{rule}.pvcs", params[field], _listed(rt.pvcs))
    nodes, gpus = int(params.get("k8s_nnodes", 1)), int(params.get("k8s_gpus_per_node", 0))
    where = f"ceilings of runtime {name}"
    for field, value, bound, what in (
            ("k8s_nnodes", nodes, ceilings.nodes, "nodes"),
            ("k8s_gpus_per_node", gpus, ceilings.gpus_per_node, "gpus_per_node"),
            ("k8s_gpus_per_node", nodes * gpus, ceilings.gpus, "gpus (pods x GPUs per pod)"),
            ("k8s_nnodes", nodes * max(gpus, 1), ceilings.ranks, "ranks (pods x GPUs per pod)"),
            ("k8s_active_deadline_s", int(params.get("k8s_active_deadline_s", 0)), ceilings.wall_clock_s,
             "wall_clock_s")):
        if bound is not None and value > bound:
            raise PolicyError(field, f"{where}: {what.split(' ')[0]}", value, f"at most {bound} ({what})")
    for field, bound, what in (("k8s_cpu_limit", ceilings.cpu_per_pod, "cpu_per_pod"),
                               ("k8s_memory_limit", ceilings.memory_per_pod, "memory_per_pod")):
        if bound is not None and _quantity(str(params.get(field))) > _quantity(bound):
            raise PolicyError(field, f"{where}: {what}", params.get(field), f"at most {bound}")


def runtime_of(params: dict[str, Any], loaded: Loaded | None = None) -> Runtime:
    """The runtime a run picked (the Param ``runtime``; none: the policy's first)."""
    runtimes = (loaded or load()).policy.runtimes
    name = params.get("runtime") or next(iter(runtimes))
    if name not in runtimes:
        raise PolicyError("runtime", "runtimes", name, _listed(list(runtimes)))
    return runtimes[name]


def record(loaded: Loaded, runtime: str, triggered_by: str | None) -> dict[str, str]:
    """The MLflow tags that say under what a run ran and who asked for it."""
    return {"policy.runtime": runtime, "policy.sha256": loaded.sha256, "policy.source": loaded.source,
            "airflow.triggered_by": triggered_by or "(no Airflow user)"}


def describe(loaded: Loaded) -> str:
    """One line for logs: the policy's source, version and runtimes."""
    return f"policy {loaded.source} sha256 {loaded.sha256[:12]}, runtimes {', '.join(loaded.policy.runtimes)}"


def check_sweep(trials: int, parallel: int, steps: int, rules: Loaded) -> None:
    """A sweep within the policy's ``sweeps`` bounds, before any trial (``PolicyError`` names the field)."""
    bounds = rules.policy.sweeps
    for field, rule, value, bound in (("trials", "sweeps.trials", trials, bounds.trials),
                                      ("max_parallel_trials", "sweeps.parallel_trials", parallel, bounds.parallel_trials),
                                      ("trials", "sweeps.total_steps", trials * steps, bounds.total_steps)):
        if bound is not None and value > bound:
            allowed = (f"at most {bound // max(1, steps)} trials of {steps} steps (or fewer steps)"
                       if rule == "sweeps.total_steps" else f"at most {bound}")
            raise PolicyError(field, rule, value, allowed)
