"""The XCom contract between the tasks of a training run: the same keys whatever the backend."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class RunOpened(TypedDict):
    """What ``open_run`` hands on: this DAG run's MLflow run and the dataset it trains on."""

    mlflow_run_id: str
    dataset_uri: str  # resolved: the Param, or the folder a data-driven run's asset event named


class Validated(RunOpened):
    """What ``validate_data`` hands on: the data passed the gate, with the fingerprint the ranks check."""

    dataset_fingerprint: str
    token_shards: NotRequired[str]  # text: the token windows the tokenize task made, which the ranks read


class Handoff(Validated):
    """What every backend's ``train_and_commit`` task group hands on: a committed checkpoint."""

    checkpoint_uri: str  # the committed step folder in the store (manifest + `latest` written)
    final_step: int
    torchrun_wall_s: float  # local: torchrun's wall time; kubernetes: the Job's start to completion


def committed(validated: Validated, *, checkpoint_uri: str, final_step: int, torchrun_wall_s: float) -> Handoff:
    """The Handoff of a backend: what ``validated`` said of the run and its data, and the commit."""
    keys = ("mlflow_run_id", "dataset_uri", "dataset_fingerprint", "token_shards")
    return Handoff(**{k: validated[k] for k in keys if k in validated}, checkpoint_uri=checkpoint_uri,  # type: ignore[typeddict-item]
                   final_step=final_step, torchrun_wall_s=torchrun_wall_s)
