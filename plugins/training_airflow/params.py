"""Typed, titled Params of the ``distributed_training`` DAG: they render as the trigger form.

The JSON-schema keywords (type, enum, minimum, pattern) are enforced by Airflow when a run is
triggered; cross-field rules the form cannot express are checked by the first task (see
``tasks.check_conf``) before anything is computed.
"""

from __future__ import annotations

from airflow.sdk import Param

from training_airflow import settings

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def training_params() -> dict[str, Param]:
    return {
        "dataset_uri": Param(
            settings.default_dataset_uri(), type="string", minLength=1, title="Dataset",
            description="Folder written by `python -m training make-data` (train/, validation/, dataset.json). "
                        "Relative paths are relative to the project folder."),
        "experiment": Param(
            "distributed_training", type="string", pattern=NAME_PATTERN, title="MLflow experiment",
            description="MLflow experiment the run is recorded in; also the first part of checkpoint keys."),
        "model": Param("mlp", type="string", enum=["mlp"], title="Model",
                       description="Model family. mlp: a tabular classifier."),
        "world_size": Param(2, type="integer", minimum=1, maximum=64, title="World size (ranks)",
                            description="Number of training processes (torchrun --nproc-per-node)."),
        "steps": Param(300, type="integer", minimum=1, maximum=10_000_000, title="Steps",
                       description="Optimizer steps in total."),
        "batch_size": Param(64, type="integer", minimum=1, maximum=1_048_576, title="Global batch size",
                            description="Samples per optimizer step over all ranks; must be divisible by the world size."),
        "lr": Param(3e-3, type="number", exclusiveMinimum=0, maximum=10, title="Learning rate",
                    description="Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."),
        "seed": Param(1234, type="integer", minimum=0, title="Seed",
                      description="Seed for weights, data order and every RNG; the same seed reproduces the run."),
        "checkpoint_every": Param(100, type="integer", minimum=0, title="Checkpoint every K steps",
                                  description="Periodic local checkpoints (0 = only the final one). A retried train task resumes from the latest."),
        "store_uri": Param(
            settings.default_store_uri(), type="string", pattern=r"^(file|s3)://.+", title="Checkpoint store",
            description="Where the final checkpoint is committed: file:///folder or s3://bucket/prefix. "
                        "S3 endpoint and credentials come from the worker's AWS_* environment, never from here."),
        "max_restarts": Param(0, type="integer", minimum=0, maximum=10, title="torchrun max restarts",
                              description="How often torchrun restarts the rank group after a rank dies."),
    }
