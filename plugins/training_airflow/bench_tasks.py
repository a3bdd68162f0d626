"""Task bodies and Params of the ``training_benchmark`` DAG (the sweep of ``python -m training bench``).

Heavy imports (torch, mlflow) happen inside the functions, never at DAG parse time.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import Param

from training.config.train_config import TrainConfig, choices
from training.config.fields import specs
from training_airflow import settings
from training_airflow.failures import fails_fast
from training_airflow.params import RunParams, param

log = logging.getLogger(__name__)


def bench_params() -> dict[str, Param]:
    """The grid's fields; the trainer's own (model, steps, batch size...) from their declarations."""
    trainer = specs(TrainConfig)

    def grid(name: str, default: list, title: str) -> Param:
        return Param(default, type="array", items={"type": "string", "enum": choices(TrainConfig, name)}, minItems=1,
                     title=title, description=f"Every value to try: {trainer[name].help}.")

    return {
        "dataset_uri": param(trainer["dataset_uri"], settings.default_dataset_uri()),
        "experiment": param(specs(RunParams)["experiment"], "training_benchmark",
                            description="experiment of the parent run and its child runs (one per grid point)"),
        "model": param(trainer["model"]),
        "world_sizes": Param([1, 2], type="array", items={"type": "integer", "minimum": 1, "maximum": 64},
                             minItems=1, title="World sizes", description="Ranks per point (torchrun --nproc-per-node)."),
        "strategies": grid("strategy", ["ddp"], "Strategies"),
        "precisions": grid("precision", ["fp32"], "Precisions"),
        "comm_hooks": grid("comm_hook", ["none"], "Gradient compression"),
        "steps": param(trainer["steps"], 100, title="Steps per point"),
        "batch_size": param(trainer["batch_size"]),
        "log_every": param(trainer["log_every"], section=None,
                           description="steps per logged interval (the report takes medians over intervals)"),
    }


def _base(params: dict[str, Any]) -> dict[str, Any]:
    return {"dataset_uri": settings.resolve_path(params["dataset_uri"]), "model": params["model"], "steps": int(params["steps"]),
            "batch_size": int(params["batch_size"]), "log_every": int(params["log_every"]), "checkpoint_every": 0}


@fails_fast
def open_parent(params: dict[str, Any], *, dag_id: str, dag_run_id: str) -> dict[str, Any]:
    """The parent MLflow run of this DAG run (a retry finds the same one) and the grid to run."""
    settings.ensure_tracking_uri()
    import torch
    from airflow.exceptions import AirflowFailException

    from training.results.bench import grid
    from training.tracking.run import open_run

    points, skipped = grid(params["world_sizes"], params["strategies"], params["precisions"], params["comm_hooks"],
                           base=_base(params), cuda=torch.cuda.is_available())
    for line in skipped:
        log.warning("skipped %s", line)
    if not points:
        raise AirflowFailException("no point of the grid can run: see the skipped points in this log")
    parent = open_run(params["experiment"], dag_id=dag_id, dag_run_id=dag_run_id, run_name=f"benchmark {dag_run_id}")
    return {"parent_run_id": parent, "points": [vars(p) for p in points]}


@fails_fast
def sweep(params: dict[str, Any], opened: dict[str, Any]) -> dict[str, Any]:
    """Every point as a child run; a retry skips the points already finished."""
    settings.ensure_tracking_uri()
    from training.results.bench import Point, run_sweep

    parent = opened["parent_run_id"]
    results = run_sweep(experiment=params["experiment"], parent_run_id=parent,
                        points=[Point(**p) for p in opened["points"]], base=_base(params),
                        work=settings.work_dir() / parent, echo=log.info)
    failed = [r["point"] for r in results if r["status"] != "FINISHED"]
    if failed:
        raise RuntimeError(f"benchmark points failed: {', '.join(failed)} (see the log above)")
    return {**opened, "results": results}


@fails_fast
def report(params: dict[str, Any], swept: dict[str, Any]) -> dict[str, Any]:
    """Comparison report of the children, logged to the parent run under comparison/."""
    settings.ensure_tracking_uri()
    from mlflow.tracking import MlflowClient

    from training.results.bench import report as write

    parent = swept["parent_run_id"]
    result = write(experiment=params["experiment"], parent_run_id=parent, out=settings.work_dir() / parent / "report")
    MlflowClient().set_terminated(parent, "FINISHED")
    log.info("comparison report of %d runs logged to run %s: %s", len(result["runs"]), parent, result["report_md"])
    return {"parent_run_id": parent, "runs": result["runs"], "plots": sorted(result["plots"])}
