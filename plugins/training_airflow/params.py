"""The trigger form of the training DAGs, generated from the dataclasses that declare each field
with ``training.config.fields.knob``: the trainer's ``training.config.train_config.TrainConfig``
(the fields ``python -m training train --set`` takes, with the deployment's defaults for paths and
``eval_every``), the run's own ``RunParams`` below (MLflow experiment, backend, ranks, store,
registry) and each enabled backend's (``backends/kubernetes/params.py``).

Airflow enforces each field's JSON schema when a run is created (the form shows the reason, the
REST API answers 400); rules between fields are checked by ``open_run`` before anything runs. The
tables in the README and docs/configuration.md come from the same declarations (scripts/config_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from airflow.sdk import Param

from training.config.train_config import TrainConfig
from training.config.fields import Spec, json_schema, knob, specs
from training_airflow import policy, settings

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RUN = "Run: where it is recorded and stored"


@dataclass(kw_only=True)
class RunParams:
    """Fields of a DAG run that are not the trainer's: where it is recorded and stored, on what."""

    experiment: str = knob("distributed_training", "MLflow experiment the run is recorded in; also the first part "
                           "of checkpoint keys", title="MLflow experiment", pattern=NAME_PATTERN)
    run_name: str | None = knob(
        None, "name of the MLflow run; empty: what it trains, e.g. mlp-ddp-fp32-2ranks-300steps (the Airflow run id "
        "is kept in the tag airflow.dag_run_id)", title="MLflow run name", schema={"maxLength": 250})
    backend: Literal["local", "kubernetes"] = knob(
        "local", "local: torchrun on the Airflow worker (world_size ranks); kubernetes: an Indexed Job of k8s_nnodes "
        "pods on a cluster (the Kubernetes section). The form offers the backends the deployment enables "
        "(TRAINING_BACKENDS)", title="Backend", tag=True)
    runtime: str = knob(
        "default", "where the run may run, as the platform defined it in the deployment's policy file "
        "(TRAINING_POLICY): image, namespace, Secrets and the most it may ask for. The form offers the policy's "
        "runtimes", title="Runtime", pattern=NAME_PATTERN, tag=True)
    world_size: int = knob(2, "training processes on the worker (torchrun --nproc-per-node) with backend=local; on "
                           "Kubernetes the pods decide (k8s_nnodes x k8s_gpus_per_node)", title="World size (ranks)",
                           minimum=1, maximum=64, tag=True)
    max_restarts: int = knob(0, "how often torchrun restarts the rank group after a rank dies (each restart resumes "
                             "from the latest checkpoint)", title="torchrun max restarts", minimum=0, maximum=10)
    store_uri: str = knob(
        "", "where the run's checkpoints are committed ({store_uri}/{experiment}/{mlflow run id}/): file:///folder or "
        "s3://bucket/prefix. S3 endpoint and credentials come from aws_conn_id or the worker's AWS_* environment, "
        "never from here", title="Checkpoint store", pattern=r"^(file|s3)://.+", section=RUN)
    checkpoint_location: Literal["store", "local"] = knob(
        "store", "store: every rank writes each checkpoint, periodic and final, straight to store_uri and a retry "
        "resumes from there, on any worker or pod, with no shared disk; local: periodic checkpoints stay on the "
        "worker's disk (backend local) or the ReadWriteMany PVC k8s_checkpoint_pvc (backend kubernetes) and only "
        "the final one is uploaded to the store after training", title="Checkpoint location", section=RUN)
    aws_conn_id: str | None = knob(
        None, "Airflow connection (type Amazon Web Services) with the S3 keys, region and endpoint_url (extra) for "
        "an s3:// store; empty: the worker's AWS_* environment. The keys reach the store as environment only, never "
        "a command line, XCom or MLflow", title="AWS connection", pattern=r"^([A-Za-z0-9_.-]{1,250})?$", section=RUN)
    registered_model: str | None = knob(
        None, "MLflow registered model the evaluated model is registered under; empty: the experiment name",
        title="Registered model", pattern=NAME_PATTERN, section=RUN)
    gate_metric: Literal["auto", "eval/accuracy", "eval/loss", "eval/r2", "eval/rmse", "eval/bits_per_byte"] = knob(
        "auto", "the metric the registry gate compares: auto = eval/accuracy for classification, eval/r2 for "
        "regression, eval/bits_per_byte for a language model; a loss, RMSE or bits per byte must fall, accuracy or "
        "R² rise", title="Registry gate metric", section=RUN)
    promotion_margin: float = knob(
        0.005, "the new model takes the registry alias `champion` only if its gate_metric beats the current "
        "champion's by more than this (absolute, in the metric's units: 0.005 = half a point of accuracy); "
        "otherwise it is registered as a challenger and the run says why", title="Promotion margin", minimum=0,
        maximum=1, section=RUN)
    registry_flavour: Literal["auto", "pt2", "pyfunc-folder"] = knob(
        "auto", "how the model is logged to MLflow: pt2 loads the whole model on the worker and exports it with "
        "torch.export (at its peak about 2.5 times the parameter bytes); pyfunc-folder logs the exported folder as a "
        "pyfunc model from code, never loading it whole; auto: pt2 when the parameters fit in a quarter of the memory "
        "the register task may still use (its cgroup limit, else MemAvailable), else pyfunc-folder. Text models are "
        "always pyfunc (pyfunc-folder: not loaded to compute their example)", title="Registry flavour", section=RUN)


def deployment_defaults() -> dict[str, Any]:
    """Form defaults that differ from the declarations: this deployment's paths, and evaluation
    during training switched on (the trainer alone leaves it off)."""
    return {"dataset_uri": settings.default_dataset_uri(), "store_uri": settings.default_store_uri(), "eval_every": 50}


def form_specs(backends: list[str] | None = None) -> list[Spec]:
    """Every field of the form, in form order: the trainer's main fields, the run's, the trainer's
    advanced ones, then each enabled backend's."""
    from training_airflow.backends import param_classes

    trainer = [s for s in specs(TrainConfig).values() if s.form]
    backend_fields = [s for cls in param_classes(backends or settings.enabled_backends()) for s in specs(cls).values()]
    return [*(s for s in trainer if s.section is None), *specs(RunParams).values(),
            *(s for s in trainer if s.section is not None), *backend_fields]


def param(spec: Spec, default: Any = None, **overrides: Any) -> Param:
    """A declared field as an Airflow ``Param`` (its JSON schema, ``overrides`` on top)."""
    schema = {k: v for k, v in {**json_schema(spec), **overrides}.items() if v is not None}
    description = schema.pop("description")
    return Param(spec.default if default is None else default,
                 description=description[:1].upper() + description[1:] + ".", **schema)


# Params whose form maximum is a ceiling of the policy (the largest any runtime allows).
CEILING_PARAMS = {"world_size": ("ranks", "local"), "steps": ("steps", None), "k8s_nnodes": ("nodes", "kubernetes"),
                  "k8s_min_nodes": ("nodes", "kubernetes"), "k8s_gpus_per_node": ("gpus_per_node", "kubernetes"),
                  "k8s_active_deadline_s": ("wall_clock_s", "kubernetes")}


def training_params(backends: list[str] | None = None, loaded: policy.Loaded | None = None) -> dict[str, Param]:
    """The Params of ``distributed_training`` and ``distributed_training_on_data`` (the enabled
    backends', unless ``backends`` names others), bounded by the deployment's policy: the runtimes
    as a dropdown, its ceilings as maxima, so the form and the REST API refuse more."""
    backends = backends or settings.enabled_backends()
    rules = (loaded or policy.load()).policy
    defaults = {**deployment_defaults(), "backend": "local" if "local" in backends else backends[0],
                "runtime": next(iter(rules.runtimes))}
    choice: dict[str, dict[str, Any]] = {"backend": {"enum": backends}, "runtime": {"enum": list(rules.runtimes)}}
    for name, (ceiling, backend) in CEILING_PARAMS.items():
        bound = rules.form_maximum(ceiling, backend)
        if bound is not None:
            choice[name] = {"maximum": bound}
    out = {}
    for s in form_specs(backends):
        default = defaults.get(s.name, s.default)
        bound = choice.get(s.name, {}).get("maximum")
        if bound is not None and s.maximum is not None:
            choice[s.name]["maximum"] = bound = min(bound, s.maximum)
        if bound is not None and isinstance(default, int) and default > bound:
            default = bound  # the form's default must be one the policy allows
        out[s.name] = param(s, default, **choice.get(s.name, {}))
    return out


def run_tags(params: dict[str, Any]) -> dict[str, str]:
    """Tags every run carries (fields declared with ``tag=True``), so MLflow's compare view lines
    runs up by them. A Param a deployment lacks is tagged with the declared default."""
    return {s.name: str(params.get(s.name, s.default)) for s in form_specs(list(settings.BACKENDS)) if s.tag}
