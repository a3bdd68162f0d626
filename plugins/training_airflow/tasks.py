"""Bodies of the backend-independent tasks of a training run: ``validate_data`` before the
backend's task group, ``evaluate``, ``register`` and ``report`` after it.

Each takes plain values and returns a small dict for XCom (run ids, URIs, numbers: never tensors or
DataFrames), one concern per task so that a retry has a clear scope. Heavy libraries are imported
inside the functions so that parsing the DAG imports none of them.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from training_airflow import backends, context, lifecycle, settings
from training_airflow.context import Handoff, Opened, fails_fast
from training_airflow.params import run_tags

log = logging.getLogger(__name__)


def _record_verdict(logger, report: dict[str, Any], docs_dir: str) -> None:
    """The data gate's verdict in the MLflow run: tags, data_validation.json (failed expectations
    with observed values, every file's sha256, row counts) and GX's Data Docs under data_docs/."""
    tags = {"data.validation": "passed" if report["success"] else "failed",
            "data.failed_expectations": len(report["failures"])}
    if report.get("fingerprint"):
        tags["data.fingerprint"] = report["fingerprint"]
    for split, rows in report.get("rows", {}).items():
        tags[f"data.rows_{split}"] = rows
    logger.set_tags({**tags, "dataset_uri": report["dataset_uri"]})
    logger.log_text(json.dumps(report, indent=2), "data_validation.json")
    if report.get("data_docs"):
        # The HTML pages and their style sheet; GX's bundled fonts and images (~4 MB) stay out.
        shutil.rmtree(Path(docs_dir) / "static" / "fonts", ignore_errors=True)
        shutil.rmtree(Path(docs_dir) / "static" / "images", ignore_errors=True)
        logger.client.log_artifacts(logger.run_id, docs_dir, "data_docs")


@fails_fast
def validate_data(params: dict[str, Any], *, dag_id: str, dag_run_id: str, dataset_uri: str | None = None) -> Opened:
    """Check the run's Params, open (or re-open) this DAG run's MLflow run, run the data gate.

    ``dataset_uri`` (from the asset event of a data-driven run) replaces the Param; later tasks
    get the resolved folder through ``Opened``."""
    settings.ensure_tracking_uri()
    from training.config import check_path_part
    from training.storage import check_writable
    from training.tracking import open_run
    from training.validation import DataValidationError, validate

    dataset = settings.resolve_path(dataset_uri or params["dataset_uri"])
    params = {**params, "dataset_uri": dataset}
    experiment = check_path_part("experiment", params["experiment"])
    world_size = backends.check_params(params)  # the backend's rules, before any rank starts
    # A missing or unreadable aws_conn_id fails here too; so do a missing bucket and denied keys.
    check_writable(params["store_uri"], context.store_env(params), field="store_uri")

    run_id = open_run(experiment, dag_id=dag_id, dag_run_id=dag_run_id, run_name=dag_run_id,
                      tags={**run_tags(params), "world_size": str(world_size)})
    logger = context.run_logger(run_id)
    log.info("MLflow run %s (experiment %s)", run_id, experiment)
    # Earlier runs of this DAG that were cancelled (no callback tells us) are KILLED from here on.
    lifecycle.reconcile(logger.client.get_run(run_id).info.experiment_id, dag_id=dag_id, current_run_id=dag_run_id)
    with tempfile.TemporaryDirectory(prefix="gx-docs-") as docs:
        try:
            report = validate(dataset, docs_dir=docs)
        except DataValidationError as e:
            _record_verdict(logger, e.report, docs)
            logger.finish("FAILED")
            raise
        _record_verdict(logger, report, docs)
    log.info("data gate passed: %s rows, fingerprint %s", report["rows"], report["fingerprint"][:16])
    return Opened(mlflow_run_id=run_id, dataset_uri=dataset, dataset_fingerprint=report["fingerprint"])


def dataset_from_events(triggering_asset_events: Any) -> str | None:
    """The dataset folder announced by the newest asset event that started this run (``None``
    for a manual or scheduled run): a data-driven run trains on the data that landed."""
    newest = None
    for events in (triggering_asset_events or {}).values():
        for event in events:
            if (event.extra or {}).get("dataset_uri") and (newest is None or event.timestamp > newest.timestamp):
                newest = event
    return newest.extra["dataset_uri"] if newest is not None else None


@fails_fast
def evaluate(params: dict[str, Any], handoff: Handoff) -> dict[str, Any]:
    """Fetch the committed checkpoint back, verify every sha256, score the validation split, then
    record the evaluation next to the checkpoint and apply retention."""
    from training.evaluate import run

    run_id = handoff["mlflow_run_id"]
    store_env = context.store_env(params)
    settings.work_dir().mkdir(parents=True, exist_ok=True)
    result = run(store_uri=params["store_uri"], experiment=params["experiment"], run_id=run_id,
                 dataset_uri=handoff["dataset_uri"], work_dir=str(settings.work_dir()), store_env=store_env)
    logger = context.run_logger(run_id)
    logger.log_metrics_once({"eval/loss": result["eval/loss"], "eval/accuracy": result["eval/accuracy"]}, step=result["step"])
    if result["warnings"]:
        for w in result["warnings"]:
            log.warning("checkpoint fallback: %s", w)
        logger.set_tags({"checkpoint.fallback": "; ".join(result["warnings"]),
                         "checkpoint.evaluated": result["checkpoint_step_dir"]})
    keep_checkpoints(params, run_id, result, store_env)
    known = ", ".join(f"{k} {result[k]:.4f}" for k in ("bayes_accuracy", "chance_accuracy", "loss_floor") if result.get(k) is not None)
    log.info("eval at step %d: loss %.4f, accuracy %.4f (%s)", result["step"], result["eval/loss"],
             result["eval/accuracy"], known or "no reference values for this dataset")
    return {**handoff, "eval_loss": result["eval/loss"], "eval_accuracy": result["eval/accuracy"],
            "eval_step": result["step"], "evaluated_step_dir": result["checkpoint_step_dir"]}


def keep_checkpoints(params: dict[str, Any], run_id: str, result: dict[str, Any], store_env: dict[str, str]) -> None:
    """Record the evaluation next to the checkpoint, then prune the run's stored checkpoints to the
    last ``retention_keep_last``, the best by eval/loss and whatever `latest` names."""
    from training.storage import StoreError, apply_retention, record_eval

    where = {"experiment": params["experiment"], "run_id": run_id, "env": store_env}
    try:
        record_eval(params["store_uri"], step_dir=result["checkpoint_step_dir"],
                    metrics={"eval/loss": result["eval/loss"], "eval/accuracy": result["eval/accuracy"]}, **where)
        keep = int(params.get("retention_keep_last", 0) or 0)
        if keep:
            r = apply_retention(params["store_uri"], keep_last=keep, metric="eval/loss", mode="min", **where)
            log.info("retention: kept %s, deleted %s", r.kept, r.deleted or "nothing")
    except StoreError as e:  # the model is evaluated; a store that cannot prune is worth a warning, not a failure
        log.warning("checkpoint retention skipped: %s", e)


@fails_fast
def register(params: dict[str, Any], scored: dict[str, Any]) -> dict[str, Any]:
    """Log the evaluated model, register it, and let it take the `champion` alias if it is better.

    The model files are fetched from the store again and verified against the manifest (the step
    folder ``evaluate`` scored), so this task may run on another worker than ``evaluate``."""
    from training import registry
    from training.checkpoint import MODEL_CONFIG_FILE, MODEL_FILE
    from training.evaluate import example_inputs, score_folder
    from training.storage import fetch_checkpoint

    run_id, dataset = scored["mlflow_run_id"], scored["dataset_uri"]
    name = params.get("registered_model") or params["experiment"]
    settings.work_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.work_dir(), prefix="register-") as tmp:
        model_dir, _, _ = fetch_checkpoint(params["store_uri"], experiment=params["experiment"], run_id=run_id,
                                           dest=tmp, env=context.store_env(params),
                                           step_dir=scored["evaluated_step_dir"], only=(MODEL_FILE, MODEL_CONFIG_FILE))
        gate = registry.register_and_gate(
            run_id=run_id, model_dir=model_dir, registered_model=name, metric_value=scored["eval_accuracy"],
            margin=float(params.get("promotion_margin", 0.0)), example_inputs=example_inputs(dataset),
            step=scored["eval_step"], data_fingerprint=scored.get("dataset_fingerprint"),
            score_model=lambda folder: score_folder(folder, dataset)["eval/accuracy"])
    log.info("registry: %s version %s is %s: %s", gate["registered_model"], gate["version"], gate["decision"], gate["reason"])
    return {**scored, "registry": gate}


@fails_fast
def report(params: dict[str, Any], registered: dict[str, Any], *, dag_run_start: datetime | None) -> dict[str, Any]:
    """Close the MLflow run and record how much of the DAG's wall time was orchestration."""
    run_id = registered["mlflow_run_id"]
    logger = context.run_logger(run_id)
    metrics = {}
    if dag_run_start is not None:
        wall = (datetime.now(timezone.utc) - dag_run_start).total_seconds()
        metrics = {"pipeline/dag_wall_s": wall, "pipeline/orchestration_overhead_s": wall - registered["torchrun_wall_s"]}
        logger.log_metrics_once(metrics, step=registered["final_step"])
    logger.finish("FINISHED")
    summary = {**registered, **metrics, "finished_unix": time.time()}
    log.info("run summary: %s", json.dumps(summary))
    return summary
