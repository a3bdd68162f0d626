"""The XCom contract between the tasks of a training run: the same keys whatever the backend."""

from __future__ import annotations

from typing import TypedDict


class RunOpened(TypedDict):
    """What ``open_run`` hands on: this DAG run's MLflow run and the dataset it trains on."""

    mlflow_run_id: str
    dataset_uri: str  # resolved: the Param, or the folder a data-driven run's asset event named


class Validated(RunOpened):
    """What ``validate_data`` hands on: the data passed the gate, with the fingerprint the ranks check."""

    dataset_fingerprint: str


class Handoff(Validated):
    """What every backend's ``train_and_commit`` task group hands on: a committed checkpoint."""

    checkpoint_uri: str  # the committed step folder in the store (manifest + `latest` written)
    final_step: int
    torchrun_wall_s: float  # local: torchrun's wall time; kubernetes: the Job's start to completion
