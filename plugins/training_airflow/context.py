"""What every task of a training run shares, whichever backend trains: the bottom of the package.

- ``Opened`` / ``Handoff``: the XCom contract between the tasks (the same keys for every backend);
- ``train_config``: the run's Params as the trainer's ``TrainConfig``, cross-field rules checked;
  ``data_options``: the Params that say how a table becomes training data;
- ``run_logger``: the MLflow run of this DAG run (one run per DAG run, see training.tracking);
- ``store_env``: S3 settings of the Airflow connection ``aws_conn_id``, as environment only;
- ``fails_fast``: the one place where bad input (``ConfigError``, a failed data gate) becomes an
  ``AirflowFailException``, which fails the task without retries.

It imports nothing of this package but ``settings`` (where things live); the task bodies and the
backends import it, never the other way round. Heavy libraries are imported inside functions.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, TypedDict, TypeVar

from airflow.sdk.exceptions import AirflowFailException

from training_airflow import settings


class Opened(TypedDict):
    """What ``validate_data`` hands on: the MLflow run and the data that passed the gate."""

    mlflow_run_id: str
    dataset_uri: str  # resolved: the Param, or the folder a data-driven run's asset event named
    dataset_fingerprint: str


class Handoff(Opened):
    """What every backend's ``train_and_commit`` task group hands on: a committed checkpoint."""

    checkpoint_uri: str  # the committed step folder in the store (manifest + `latest` written)
    final_step: int
    torchrun_wall_s: float  # local: torchrun's wall time; kubernetes: the Job's start to completion


F = TypeVar("F", bound=Callable[..., Any])


def fails_fast(fn: F) -> F:
    """Bad input fails the task at once and for good (no retry would fix it): a config the trainer
    refuses and a dataset that fails the data gate. Anything else propagates, so Airflow retries."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from training.fields import ConfigError

        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            raise AirflowFailException(f"invalid run parameters: {e}") from None
        except Exception as e:
            if type(e).__name__ == "DataValidationError":  # training.validation, imported only when used
                raise AirflowFailException(str(e)) from None
            raise

    return wrapper  # type: ignore[return-value]


def train_config(params: dict[str, Any], *, world_size: int | None = None, checkpoint_dir: str = "-",
                 output_dir: str = "", dataset_uri: str | None = None, dataset_fingerprint: str = "") -> Any:
    """The run's Params as a ``TrainConfig``; raises ``ConfigError`` naming the field.

    Every field of the trainer that is a Param is taken as is (a Param a deployment lacks keeps the
    trainer's default); the rules that need the launch size are checked too, and the model against
    the kind a local ``dataset.json`` declares (the data and the model themselves are checked by
    ``validate_data`` once the gate has read the data). ``dataset_fingerprint``: what the gate
    recorded, for the ranks to compare with what they read."""
    from training.config import TrainConfig
    from training.fields import specs

    values = {name: params[name] for name, spec in specs(TrainConfig).items() if spec.form and name in params}
    values["dataset_uri"] = settings.resolve_path(dataset_uri or params["dataset_uri"])
    cfg = TrainConfig(**values, checkpoint_dir=checkpoint_dir, output_dir=output_dir,
                      dataset_fingerprint=dataset_fingerprint)
    cfg.check_world_size(int(world_size or params["world_size"]))
    if Path(cfg.dataset_uri, "dataset.json").is_file():  # a missing dataset is the data gate's to report
        from training.datasets import read_meta

        meta = read_meta(cfg.dataset_uri)
        if "kind" in meta:
            cfg.check_dataset(meta)
    return cfg


def data_options(params: dict[str, Any]) -> Any:
    """The run's label, features, task and split (``training.tables.DataOptions``); a Param a
    deployment lacks keeps the trainer's default."""
    from types import SimpleNamespace

    from training.config import TrainConfig
    from training.fields import specs
    from training.tables import DataOptions

    fields = specs(TrainConfig)
    names = ("label_column", "feature_columns", "task", "validation_fraction", "split_seed")
    return DataOptions.of(SimpleNamespace(**{n: params.get(n, fields[n].default) for n in names}))


def run_logger(run_id: str) -> Any:
    """The MLflow run of this DAG run (``training.tracking.RunLogger``)."""
    settings.ensure_tracking_uri()
    from training.tracking import RunLogger

    return RunLogger(run_id)


def work_dir(run_id: str) -> Path:
    """This run's folder on the worker, keyed by the MLflow run: stable across task retries."""
    return settings.work_dir() / run_id


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def store_env(params: dict[str, Any]) -> dict[str, str]:
    """``AWS_*`` settings for the checkpoint store from ``params['aws_conn_id']``; {} when unset.

    With the Param empty, the store reads the worker's own ``AWS_*`` environment (or boto3's chain:
    profile, container or instance role). With it set, the amazon provider's ``AwsBaseHook``
    resolves the connection (keys, session token, assumed role, region, ``endpoint_url`` in the
    extra). The mapping goes to the store object in this process, or into the environment of the
    torchrun child; never on a command line, in a Param, XCom or MLflow, and every secret in it is
    registered with Airflow's secrets masker in case anything prints it."""
    conn_id = (params.get("aws_conn_id") or "").strip()
    if not conn_id:
        return {}
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    try:
        hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
        creds = hook.get_credentials()
        endpoint = hook.conn_config.get_service_endpoint_url("s3")
        region = hook.region_name
    except Exception as e:
        # The exception text is the provider's; it names the connection, not its password.
        raise AirflowFailException(
            f"aws_conn_id {conn_id!r}: cannot read the AWS connection ({type(e).__name__}); create it "
            "(Admin > Connections, type 'Amazon Web Services') or clear aws_conn_id to use the worker's AWS_* "
            "environment") from None
    env: dict[str, str] = {}
    if creds and creds.access_key and creds.secret_key:
        env.update(AWS_ACCESS_KEY_ID=creds.access_key, AWS_SECRET_ACCESS_KEY=creds.secret_key)
        if creds.token:
            env["AWS_SESSION_TOKEN"] = creds.token
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    if region:
        env["AWS_DEFAULT_REGION"] = region
    from airflow.sdk.log import mask_secret

    for secret in (env.get("AWS_SECRET_ACCESS_KEY"), env.get("AWS_SESSION_TOKEN")):
        if secret:
            mask_secret(secret)
    return env
