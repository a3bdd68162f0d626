"""Params and task body of the ``register_dataset`` DAG: new data lands, passes the gate, is announced.

The task writes a fresh ``teacher`` dataset (or takes a folder someone dropped as it is), runs the
same Great Expectations gate as training, and returns what the Asset event carries: where the
data is and its fingerprint. Data that fails the gate fails the task, so no event is emitted and
no retraining starts.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import Param
from airflow.sdk.exceptions import AirflowFailException

from training_airflow import settings
from training_airflow.failures import fails_fast

log = logging.getLogger(__name__)


def register_params() -> dict[str, Param]:
    return {
        "dataset_uri": Param(
            settings.default_dataset_uri(), type="string", minLength=1, title="Dataset folder",
            description="Where the dataset is (or is written): train/, validation/, dataset.json. Relative paths "
                        "are relative to the project folder. Retraining runs read it from here."),
        "generate": Param(
            True, type="boolean", title="Generate fresh data",
            description="On: write a new synthetic `teacher` dataset into the folder (replacing what is there). "
                        "Off: register the folder as it is (data someone dropped there)."),
        "train_rows": Param(20_000, type="integer", minimum=100, maximum=10_000_000, title="Training rows",
                            description="Rows of the train split (when generating)."),
        "val_rows": Param(4_000, type="integer", minimum=100, maximum=1_000_000, title="Validation rows",
                          description="Rows of the validation split (when generating)."),
        "label_noise": Param(0.1, type="number", minimum=0, maximum=0.9, title="Label noise",
                             description="Share of labels replaced at random (when generating); the best reachable "
                                         "accuracy is 1 - noise x (classes - 1) / classes."),
        "seed": Param(0, type="integer", minimum=0, title="Seed",
                      description="Seed of the generator: the same seed writes the same bytes (same fingerprint)."),
    }


@fails_fast
def register_dataset(params: dict[str, Any]) -> dict[str, Any]:
    """Write or take the dataset, run the data gate, return the Asset event's extra."""
    from training.data.gate import validate

    from training_airflow import policy

    policy.check_dataset(params["dataset_uri"], resolve=settings.resolve_path)  # before anything is written
    root = settings.resolve_path(params["dataset_uri"])
    if params["generate"]:
        from training.data.synthetic import make_teacher_dataset

        make_teacher_dataset(root, n_train=int(params["train_rows"]), n_val=int(params["val_rows"]),
                             label_noise=float(params["label_noise"]), seed=int(params["seed"]))
        log.info("wrote a teacher dataset to %s", root)
    try:
        report = validate(root)
    except FileNotFoundError as e:  # a folder that is not there: bad input, like a failed gate
        raise AirflowFailException(f"not registering {root}: {e}") from None
    log.info("data gate passed: %s rows, fingerprint %s", report["rows"], report["fingerprint"][:16])
    return {"dataset_uri": root, "fingerprint": report["fingerprint"], "rows": report["rows"]}
