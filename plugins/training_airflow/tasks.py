"""Bodies of the ``distributed_training`` tasks. Each takes plain values and returns a small dict
for XCom (run ids, URIs, numbers: never tensors or DataFrames). Heavy libraries are imported
inside the functions so that parsing the DAG imports none of them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from training_airflow import connections, launcher, settings

log = logging.getLogger(__name__)

# Params that become TrainConfig fields verbatim.
TRAIN_FIELDS = ("model", "strategy", "precision", "comm_hook", "grad_accum", "steps", "batch_size", "lr", "seed",
                "checkpoint_every", "eval_every", "target_metric")


def train_config(params: dict[str, Any], *, checkpoint_dir: str = "-", output_dir: str = "") -> Any:
    """Params -> TrainConfig, refusing bad values (including cross-field rules) with the field name."""
    from training.config import ConfigError, TrainConfig

    try:
        values = {k: params[k] for k in TRAIN_FIELDS}
        cfg = TrainConfig(**values, target_value=params.get("target_value"),
                          dataset_uri=settings.resolve_path(params["dataset_uri"]),
                          checkpoint_dir=checkpoint_dir, output_dir=output_dir)
        cfg.check_world_size(int(params["world_size"]))
        if Path(cfg.dataset_uri, "dataset.json").is_file():  # a missing dataset is the data gate's to report
            from training.datasets import read_meta

            cfg.check_dataset(read_meta(cfg.dataset_uri))
    except ConfigError as e:
        raise AirflowFailException(f"invalid run parameters: {e}") from None
    return cfg


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


def _logger(run_id: str):
    from training.tracking import RunLogger

    return RunLogger(run_id)


def validate_data(params: dict[str, Any], *, dag_id: str, dag_run_id: str, dataset_uri: str | None = None) -> dict[str, Any]:
    """Open (or re-open) this DAG run's MLflow run, check the config, then run the data gate.

    ``dataset_uri`` (from the asset event of a data-driven run) replaces the Param; later tasks
    get it through the handoff."""
    settings.ensure_tracking_uri()
    params = with_dataset(params, dataset_uri)
    from training.config import ConfigError, check_path_part
    from training.tracking import open_run

    try:
        experiment = check_path_part("experiment", params["experiment"])
    except ConfigError as e:
        raise AirflowFailException(str(e)) from None
    backend, world_size = params.get("backend", "local"), params["world_size"]
    if backend == "kubernetes":  # the pods' rules: world sizes from k8s_nnodes, an s3 store, an MLflow server
        from training_airflow import kubernetes

        kubernetes.check_params(params, worker_tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
        world_size = kubernetes.world_sizes(params)[-1]
    else:
        train_config(params)  # cross-field rules fail here, before any rank starts
    connections.store_env(params)  # a missing or unreadable aws_conn_id fails here too

    run_id = open_run(experiment, dag_id=dag_id, dag_run_id=dag_run_id, run_name=dag_run_id,
                      tags={**run_tags(params), "backend": backend, "world_size": str(world_size)})
    logger = _logger(run_id)
    log.info("MLflow run %s (experiment %s)", run_id, experiment)

    from training.validation import DataValidationError, validate

    dataset = settings.resolve_path(params["dataset_uri"])
    with tempfile.TemporaryDirectory(prefix="gx-docs-") as docs:
        try:
            report = validate(dataset, docs_dir=docs)
        except DataValidationError as e:
            _record_verdict(logger, e.report, docs)
            logger.finish("FAILED")
            raise AirflowFailException(str(e)) from None
        _record_verdict(logger, report, docs)
    log.info("data gate passed: %s rows, fingerprint %s", report["rows"], report["fingerprint"][:16])
    return {"mlflow_run_id": run_id, "dataset_fingerprint": report["fingerprint"], "dataset_uri": dataset}


# Tags every run carries, so MLflow's compare view lines runs up by them. A Param a deployment
# does not have yet is tagged with the trainer's default.
RUN_TAG_DEFAULTS = {"backend": "local", "world_size": 1, "model": "mlp", "strategy": "ddp", "precision": "fp32"}


def run_tags(params: dict[str, Any]) -> dict[str, str]:
    return {k: str(params.get(k, default)) for k, default in RUN_TAG_DEFAULTS.items()}


def with_dataset(params: dict[str, Any], dataset_uri: str | None) -> dict[str, Any]:
    return {**params, "dataset_uri": dataset_uri} if dataset_uri else params


def dataset_from_events(triggering_asset_events: Any) -> str | None:
    """The dataset folder announced by the newest asset event that started this run (``None``
    for a manual or scheduled run): a data-driven run trains on the data that landed."""
    newest = None
    for events in (triggering_asset_events or {}).values():
        for event in events:
            if (event.extra or {}).get("dataset_uri") and (newest is None or event.timestamp > newest.timestamp):
                newest = event
    return newest.extra["dataset_uri"] if newest is not None else None


def train(params: dict[str, Any], handoff: dict[str, Any]) -> dict[str, Any]:
    """Start torchrun with ``world_size`` ranks; a retry resumes from the latest local checkpoint."""
    settings.ensure_tracking_uri()
    params = with_dataset(params, handoff.get("dataset_uri"))
    run_id = handoff["mlflow_run_id"]
    run_dir = settings.work_dir() / run_id  # keyed by the MLflow run: stable across task retries
    cfg = train_config(params, checkpoint_dir=str(run_dir / "checkpoints"), output_dir=str(run_dir / "output"))
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "train_config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    import torch  # the ranks run on this machine: refuse what its hardware cannot do, without a retry

    try:
        cfg.check_device(torch.cuda.is_available())
    except ValueError as e:
        raise AirflowFailException(f"invalid run parameters: {e}") from None

    nproc = int(params["world_size"])
    cmd = launcher.torchrun_command(nproc=nproc, config_path=config_path, max_restarts=int(params["max_restarts"]),
                                    port=launcher.free_port())
    # S3 settings of aws_conn_id (if any) travel as environment of the ranks, never as arguments.
    env = launcher.rank_env(nproc, {**connections.store_env(params), "MLFLOW_RUN_ID": run_id,
                                    "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]})
    result = launcher.run_streaming(cmd, env=env, cwd=settings.PROJECT_ROOT)
    if result.returncode != 0:
        raise launcher.TrainingFailed(launcher.explain_failure(result))

    summary = json.loads((run_dir / "output" / "train_summary.json").read_text())
    _logger(run_id).log_metrics_once({"pipeline/torchrun_wall_s": result.wall_s}, step=summary["final_step"])
    return {**handoff, "mlflow_run_id": run_id, "checkpoint_path": summary["checkpoint_path"],
            "final_step": summary["final_step"], "torchrun_wall_s": result.wall_s}


def upload_checkpoint(params: dict[str, Any], handoff: dict[str, Any]) -> dict[str, Any]:
    """Commit the final checkpoint to the store: objects, then manifest.json, then `latest`."""
    settings.ensure_tracking_uri()
    from training.storage import StoreError, upload_checkpoint as upload

    run_id = handoff["mlflow_run_id"]
    try:
        c = upload(handoff["checkpoint_path"], params["store_uri"], experiment=params["experiment"], run_id=run_id,
                   env=connections.store_env(params))
    except StoreError as e:
        raise RuntimeError(f"checkpoint upload failed: {e}") from None
    log.info("committed %s (%d objects uploaded, %d already there) in %.2fs", c.uri, c.uploaded, c.skipped, c.seconds)
    logger = _logger(run_id)
    logger.set_tags({"checkpoint.uri": c.uri})
    logger.log_metrics_once({"ckpt/upload_s": c.seconds}, step=handoff["final_step"])
    return {**handoff, "checkpoint_uri": c.uri}


def evaluate(params: dict[str, Any], handoff: dict[str, Any]) -> dict[str, Any]:
    """Fetch the committed checkpoint back, verify every sha256, score the validation split."""
    settings.ensure_tracking_uri()
    from training.evaluate import run

    params = with_dataset(params, handoff.get("dataset_uri"))
    run_id = handoff["mlflow_run_id"]
    settings.work_dir().mkdir(parents=True, exist_ok=True)
    model_dir = settings.work_dir() / run_id / "evaluated_model"
    dataset = settings.resolve_path(params["dataset_uri"])
    store_env = connections.store_env(params)
    result = run(store_uri=params["store_uri"], experiment=params["experiment"], run_id=run_id,
                 dataset_uri=dataset, work_dir=str(settings.work_dir()), keep_model_in=str(model_dir),
                 store_env=store_env)
    logger = _logger(run_id)
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
    gate = register_model(params, handoff, model_dir=model_dir, dataset=dataset, accuracy=result["eval/accuracy"],
                          step=result["step"])
    return {**handoff, "eval_loss": result["eval/loss"], "eval_accuracy": result["eval/accuracy"], "registry": gate}


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


def register_model(params: dict[str, Any], handoff: dict[str, Any], *, model_dir: Path, dataset: str,
                   accuracy: float, step: int) -> dict[str, Any]:
    """Log the evaluated model, register it, and let it take the `champion` alias if it is better."""
    from training import registry
    from training.evaluate import example_inputs, score_folder

    name = params.get("registered_model") or params["experiment"]
    gate = registry.register_and_gate(
        run_id=handoff["mlflow_run_id"], model_dir=model_dir, registered_model=name, metric_value=accuracy,
        margin=float(params.get("promotion_margin", 0.0)), example_inputs=example_inputs(dataset), step=step,
        data_fingerprint=handoff.get("dataset_fingerprint"),
        score_model=lambda folder: score_folder(folder, dataset)["eval/accuracy"])
    log.info("registry: %s version %s is %s: %s", gate["registered_model"], gate["version"], gate["decision"], gate["reason"])
    return gate


def report(params: dict[str, Any], handoff: dict[str, Any], *, dag_run_start: datetime | None) -> dict[str, Any]:
    """Close the MLflow run and record how much of the DAG's wall time was orchestration."""
    settings.ensure_tracking_uri()
    run_id = handoff["mlflow_run_id"]
    logger = _logger(run_id)
    metrics = {}
    if dag_run_start is not None:
        wall = (datetime.now(timezone.utc) - dag_run_start).total_seconds()
        metrics = {"pipeline/dag_wall_s": wall, "pipeline/orchestration_overhead_s": wall - handoff["torchrun_wall_s"]}
        logger.log_metrics_once(metrics, step=handoff["final_step"])
    logger.finish("FINISHED")
    summary = {**handoff, **metrics, "finished_unix": time.time()}
    log.info("run summary: %s", json.dumps(summary))
    return summary
