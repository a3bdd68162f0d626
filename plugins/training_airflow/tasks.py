"""Bodies of the backend-independent tasks of a training run: ``open_run`` and ``validate_data``
before the backend's task group, ``evaluate``, ``register`` and ``report`` after it.

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

from training_airflow import backends, lifecycle, links, policy, settings
from training_airflow.conf_check import check_conf
from training_airflow.connections import store_env
from training_airflow.failures import fails_fast
from training_airflow.handoff import Handoff, RunOpened, Validated
from training_airflow.mlflow_run import run_logger
from training_airflow.run_config import data_options, train_config
from training_airflow.params import run_tags, training_params

log = logging.getLogger(__name__)


def _record_verdict(logger, report: dict[str, Any], docs_dir: str) -> None:
    """The data gate's verdict in the MLflow run: tags, data_validation.json (failed expectations
    with observed values, every file's sha256, row counts), data_schema.json (what the data is:
    layout, label, features, task and why, train's columns and classes, the schema checked), the
    one-page summary data_gate.html and GX's Data Docs under data_docs/; the data as the run's
    dataset input when it passed."""
    from training.results.reports import data_gate_page

    tags = {"data.validation": "passed" if report["success"] else "failed",
            "data.failed_expectations": len(report["failures"])}
    if report.get("cached_from"):  # the same bytes and suite passed before: that verdict, not a new run
        tags["data.validation_reused_from"] = datetime.fromtimestamp(
            report["cached_from"]["validated_unix"] or 0, timezone.utc).isoformat(timespec="seconds")
    if report.get("fingerprint"):
        tags["data.fingerprint"] = report["fingerprint"]
    for split, rows in report.get("rows", {}).items():
        tags[f"data.rows_{split}"] = rows
    data_schema = report.get("data_schema")
    if data_schema:
        described = data_schema.get("description") or {}
        tags.update({f"data.{k}": described[k] for k in ("task", "task_reason", "label") if described.get(k)})
        tags.update({"data.layout": data_schema["layout"], "data.schema": data_schema["schema_source"]})
        if "split" in data_schema:
            split = data_schema["split"]
            tags["data.split"] = f"hash split: validation_fraction={split['validation_fraction']}, " \
                                 f"split_seed={split['split_seed']}"
        logger.log_text(json.dumps(data_schema, indent=2), "data_schema.json")
    logger.set_tags({**tags, "dataset_uri": report["dataset_uri"]})
    logger.log_text(json.dumps(report, indent=2), "data_validation.json")
    logger.log_text(data_gate_page(report), "data_gate.html")
    if report["success"] and report.get("fingerprint"):
        logger.log_dataset(Path(report["dataset_uri"]).name, uri=report["dataset_uri"], fingerprint=report["fingerprint"],
                           schema=report.get("schema") or {}, rows=report.get("rows", {}))
    if report.get("data_docs"):
        # The HTML pages and their style sheet; GX's bundled fonts and images (~4 MB) stay out.
        shutil.rmtree(Path(docs_dir) / "static" / "fonts", ignore_errors=True)
        shutil.rmtree(Path(docs_dir) / "static" / "images", ignore_errors=True)
        logger.client.log_artifacts(logger.run_id, docs_dir, "data_docs")


def run_name(params: dict[str, Any], world_size: int) -> str:
    """The MLflow run's name: the ``run_name`` Param, else what the run trains, readable at a glance
    (``mlp-ddp-fp32-2ranks-300steps``); the Airflow run id stays in the tag ``airflow.dag_run_id``."""
    given = (params.get("run_name") or "").strip()
    if given:
        return given
    model = str(params.get("model", ""))
    # hf: its folder's name (my-gpt2); a factory: its function's name
    model = model.removeprefix("hf:").rstrip("/").rsplit("/", 1)[-1] if model.startswith("hf:") else model.rsplit(":", 1)[-1]
    parts = [v for v in (model, params.get("strategy"), params.get("precision")) if v]
    return "-".join([*parts, f"{world_size}rank{'s' if world_size != 1 else ''}", f"{params.get('steps')}steps"])


@fails_fast
def open_run(params: dict[str, Any], *, dag_id: str, dag_run_id: str, dataset_uri: str | None = None,
             dag_run: Any = None, param_spec: dict[str, Any] | None = None, tags: dict[str, str] | None = None) -> RunOpened:
    """Check the run's Params (the backend's rules, the rules between fields, the store's access),
    then open this DAG run's MLflow run, or re-open it on a retry: one MLflow run per DAG run.

    ``dataset_uri`` (from the asset event of a data-driven run) replaces the Param; later tasks
    get the resolved folder through ``RunOpened``. ``dag_run`` (the task context's) gives the MLflow
    run the link back to Airflow, and its conf is checked first: a key that is not a Param (a run
    made past the api-server's check: ``airflow dags trigger --conf``, TriggerDagRunOperator) fails
    the run here, and so does a run outside the deployment's policy (``policy.check``), before any
    user code is imported; the MLflow run records the runtime, the policy's sha256 and who
    triggered it. Earlier runs of this DAG that were cancelled are marked KILLED. ``param_spec``:
    the DAG's Params when they are not ``training_params()`` (a sweep's); ``tags``: more tags."""
    check_conf(getattr(dag_run, "conf", None), param_spec or training_params(), dag_id=dag_id)  # Airflow let it in unchecked
    dataset = settings.resolve_path(dataset_uri or params["dataset_uri"])
    params = {**params, "dataset_uri": dataset}
    # The deployment's policy, before anything of the user's is imported or any compute is spent.
    rules = policy.load()
    runtime = policy.check(params, rules, resolve=settings.resolve_path)
    log.info("within the deployment %s: runtime %s", policy.describe(rules), runtime)
    settings.ensure_tracking_uri()
    from training.config.train_config import check_path_part
    from training.store import check_writable
    from training.tracking.run import open_run as open_mlflow_run

    experiment = check_path_part("experiment", params["experiment"])
    world_size = backends.check_params(params)  # the backend's rules, before any rank starts
    train_config(params)
    s3_env = store_env(params)  # a missing or unreadable aws_conn_id fails here too
    check_writable(params["store_uri"], s3_env, field="store_uri")  # so do a missing bucket and denied keys

    run_id = open_mlflow_run(experiment, dag_id=dag_id, dag_run_id=dag_run_id, run_name=run_name(params, world_size),
                             tags={**run_tags(params), "world_size": str(world_size), **(tags or {})})
    logger = run_logger(run_id)
    logger.set_tags(policy.record(rules, runtime, getattr(dag_run, "triggering_user_name", None)))
    if dag_run is not None:
        logger.set_tags(links.airflow_tags(dag_run))
    log.info("MLflow run %s (experiment %s): %s", run_id, experiment, links.mlflow_run_page(dag_id, dag_run_id))
    # Earlier runs of this DAG that were cancelled (no callback tells us) are KILLED from here on.
    lifecycle.reconcile(logger.client.get_run(run_id).info.experiment_id, dag_id=dag_id, current_run_id=dag_run_id)
    from training.tracking.page import describe

    describe(run_id)  # from the start the run's page says who asked for it and under which policy
    return RunOpened(mlflow_run_id=run_id, dataset_uri=dataset)


@fails_fast
def validate_data(params: dict[str, Any], opened: RunOpened) -> Validated:
    """Run the data gate on every split and record its verdict in the MLflow run, then check the
    model against the data (a factory built and run on two rows). Bad data or a model that does
    not fit marks the MLflow run FAILED and fails the task without retries."""
    from training.data.gate import DataValidationError, gate_cached
    from training.data.options import DataOptions
    from training.tracking.page import describe
    from training.util import machine_cache_dir

    run_id, dataset = opened["mlflow_run_id"], opened["dataset_uri"]
    params = {**params, "dataset_uri": dataset}
    cfg = train_config(params)
    logger = run_logger(run_id)
    with tempfile.TemporaryDirectory(prefix="gx-docs-") as docs:
        try:
            report, data = gate_cached(dataset, cache_dir=machine_cache_dir() / "data_gate", options=DataOptions.of(cfg),
                                       env=store_env(params), docs_dir=docs)
        except DataValidationError as e:
            _record_verdict(logger, e.report, docs)
            logger.finish("FAILED")
            raise
        _record_verdict(logger, report, docs)
    described = report["data_schema"].get("description") or {}
    log.info("data gate passed: %s rows, fingerprint %s; %s%s", report["rows"], report["fingerprint"][:16],
             described.get("task_reason", ""),
             " (the verdict of an earlier run on the same bytes and suite)" if report.get("cached_from") else "")
    if cfg.is_text:  # the model reads tokens: checked once the tokenize task made them
        _load_tokenizer_file(cfg, params)
    else:
        check_model(params, cfg, data)
    describe(run_id)
    return Validated(**opened, dataset_fingerprint=report["fingerprint"])


def _load_tokenizer_file(cfg: Any, params: dict[str, Any]) -> None:
    """A tokenizer.json the run names must load, before anything else is spent on the run."""
    from training.data.tokenizer import resolve

    if cfg.tokenizer and cfg.tokenizer != "bytes" and not cfg.tokenizer.startswith("bpe:"):
        loaded = resolve(cfg.tokenizer, train_documents=lambda: [], env=store_env(params))
        log.info("tokenizer %s loads: %d tokens, end of text %d", cfg.tokenizer, loaded.vocab_size, loaded.eot_id)


@fails_fast
def tokenize(params: dict[str, Any], validated: Validated) -> Validated:
    """Text: tokenize every split once, pack the documents into windows of ``seq_len + 1`` tokens
    and write them to the store, keyed by the data, the tokenizer and ``seq_len`` (a second run on
    the same finds them), then check the model on them; the ranks read the windows, never the text.
    Tables: nothing to tokenize, the run goes on as it came."""
    cfg = train_config({**params, "dataset_uri": validated["dataset_uri"]})
    if not cfg.is_text:
        log.info("a table of numbers: nothing to tokenize")
        return validated
    from training.data.dataset import open_dataset
    from training.data.tokens import build_for, open_shards
    from training.models import hf

    s3_env = store_env(params)
    data = open_dataset(validated["dataset_uri"], data_options(params), env=s3_env,
                        expect_fingerprint=validated["dataset_fingerprint"])
    built, loaded = build_for(cfg, data, params["store_uri"], s3_env,
                              model_folder=hf.folder(cfg.model, s3_env) if hf.is_hf(cfg.model) else None)
    _record_tokens(run_logger(validated["mlflow_run_id"]), built, loaded)
    splits = built.stats["splits"]
    log.info("tokens %s (%s, %.1fs): %s", built.uri, "found: the same data, tokenizer and seq_len" if built.cache_hit
             else "made", built.seconds, ", ".join(f"{k} {v['documents']} documents, {v['bytes']} bytes, {v['tokens']} "
                                                   f"tokens, {v['windows']} windows" for k, v in splits.items()))
    check_model(params, cfg, open_shards(built.uri, s3_env), token_shards=built.uri)
    return Validated(**validated, token_shards=built.uri)


def _record_tokens(logger, built: Any, loaded: Any) -> None:
    """What the run records of its text: the tokenizer (a tag, and its file), whether the shards
    were found, documents, bytes and tokens per split, tokens per byte and the share of the text
    the tokenizer could not represent."""
    tags = {"tokens.uri": built.uri, "tokens.cache": "hit" if built.cache_hit else "made", "tokenizer": loaded.source,
            "tokenizer.sha256": loaded.sha256, "tokenizer.vocab_size": loaded.vocab_size}
    figures: dict[str, float] = {"tokenize_s": built.seconds}
    for split, s in built.stats["splits"].items():
        for k in ("documents", "bytes", "tokens", "windows"):
            figures[f"{split}_{k}"] = float(s[k])
        if s.get("tokens_per_byte") is not None:
            figures[f"{split}_tokens_per_byte"] = float(s["tokens_per_byte"])
        figures[f"{split}_unrepresented_share"] = float(s.get("unrepresented_share") or 0.0)
        for k in ("answer_tokens", "truncated", "truncated_share", "fill"):  # SFT examples, packed
            if k in s:
                figures[f"{split}_{k}"] = float(s[k])
    if "sft" in built.stats:
        tags["sft.rendering"] = built.stats["sft"]["rendering"]
    logger.set_tags(tags)
    logger.log_summary(figures)
    logger.log_text(loaded.to_json(), "tokenizer/tokenizer.json")


def check_model(params: dict[str, Any], cfg: Any, data: Any, *, token_shards: str | None = None) -> None:
    """Before any rank starts: the model reads this kind of data, the target and gate metrics are
    measured for its task, and the model (a factory: imported, called, run on two rows) gives
    outputs of the right shape. A ConfigError names the field (``model`` with the factory path).
    ``token_shards``: text, checked on its token windows."""
    import dataclasses

    from training.results.registry import gate_metric
    from training.train import prepare

    if token_shards:
        cfg = dataclasses.replace(cfg, token_shards=token_shards)
    spec = prepare(cfg, data, memory_check=lambda spec, train: check_memory(params, cfg, spec, train)).spec
    gate_metric(params.get("gate_metric", "auto"), spec.task)
    log.info("model %s checked on two rows: %s, %s", cfg.model, spec.kind, spec.task)


def check_memory(params: dict[str, Any], cfg: Any, spec: Any, train: Any) -> Any:
    """The memory preflight before launch: each rank's estimated peak against its share of the
    memory the backend gives it (after the model's check on two rows); a ConfigError names the changes that
    fit. Returns the estimate (None: not checked here). The ranks check again, where they run."""
    from training.metrics.memory import estimate_run
    from training.metrics.preflight import check, has_blocks

    budget, world = backends.memory_budget(params)

    def estimate_for(c: Any, ws: int) -> Any:
        return estimate_run(c, spec, train, world_size=ws)

    if budget is None:
        log.info("memory: the ranks check their GPU's free memory themselves")
        return None
    est = estimate_for(cfg, world)
    log.info("memory: each rank's estimated peak %s; budget %s", est.line(), budget.describe())
    check(est, budget, cfg, world, estimate_for=estimate_for, has_blocks=has_blocks(cfg), where="(checked before launch)")
    return est


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
    from training.evaluate import run, summary_line

    run_id = handoff["mlflow_run_id"]
    s3_env = store_env(params)
    settings.work_dir().mkdir(parents=True, exist_ok=True)
    result = run(store_uri=params["store_uri"], experiment=params["experiment"], run_id=run_id,
                 dataset_uri=handoff["dataset_uri"], work_dir=str(settings.work_dir()), store_env=s3_env,
                 options=data_options(params), token_shards=handoff.get("token_shards"))
    figures = {k: v for k, v in result.items() if k.startswith("eval/")}
    logger = run_logger(run_id)
    logger.log_metrics_once(figures, step=result["step"])
    if result.get("report"):
        _log_evaluation_report(logger, result["report"], result["step"])
    if result.get("samples"):
        _log_samples(logger, result["samples"])
    if result["warnings"]:
        for w in result["warnings"]:
            log.warning("checkpoint fallback: %s", w)
        logger.set_tags({"checkpoint.fallback": "; ".join(result["warnings"]),
                         "checkpoint.evaluated": result["checkpoint_step_dir"]})
    keep_checkpoints(params, run_id, result, s3_env)
    known = ", ".join(f"{k} {result[k]:.4f}" for k in ("bayes_accuracy", "chance_accuracy", "loss_floor") if result.get(k) is not None)
    log.info("eval at step %d: %s (%s)", result["step"], summary_line(figures),
             known or "no reference values for this dataset")
    return {**handoff, "eval_loss": result["eval/loss"], "eval_accuracy": result.get("eval/accuracy"),
            "eval_metrics": figures, "task": result["task"], "eval_step": result["step"],
            "evaluated_step_dir": result["checkpoint_step_dir"]}


def _log_samples(logger, samples: dict[str, Any]) -> None:
    """samples/: a few validation prompts continued by the model, greedy and sampled, as the run's
    page shows them (samples.md) and as data (samples.json)."""
    from training.results.reports import samples_markdown

    logger.log_text(samples_markdown(samples), "samples/samples.md")
    logger.log_text(json.dumps(samples, indent=2, ensure_ascii=False), "samples/samples.json")


def _log_evaluation_report(logger, report: dict[str, Any], step: int) -> None:
    """evaluation/: report.html (a classifier's per-class precision and recall and its confusion
    matrix; a regressor's residuals), report.json and the pictures (training/results/reports.py)."""
    from training.results.reports import evaluation_files

    with tempfile.TemporaryDirectory(prefix="evaluation-") as tmp:
        evaluation_files(report, Path(tmp), step=step)
        logger.client.log_artifacts(logger.run_id, tmp, "evaluation")


def keep_checkpoints(params: dict[str, Any], run_id: str, result: dict[str, Any], s3_env: dict[str, str]) -> None:
    """Record the evaluation next to the checkpoint, then prune the run's stored checkpoints to the
    last ``retention_keep_last``, the best by eval/loss and whatever `latest` names."""
    from training.checkpoint.retention import apply_retention, record_eval
    from training.store.base import StoreError

    where = {"experiment": params["experiment"], "run_id": run_id, "env": s3_env}
    try:
        record_eval(params["store_uri"], step_dir=result["checkpoint_step_dir"],
                    metrics={k: v for k, v in result.items() if k.startswith("eval/")}, **where)
        keep = int(params.get("retention_keep_last", 0) or 0)
        if keep:
            r = apply_retention(params["store_uri"], keep_last=keep, metric="eval/loss", mode="min", **where)
            log.info("retention: kept %s, deleted %s", r.kept, r.deleted or "nothing")
    except StoreError as e:  # the model is evaluated; a store that cannot prune is worth a warning, not a failure
        log.warning("checkpoint retention skipped: %s", e)


@fails_fast
def register(params: dict[str, Any], scored: dict[str, Any]) -> dict[str, Any]:
    """Log the evaluated model, register it, and let it take the `champion` alias if it is better
    on the run's gate metric (``gate_metric``; auto: accuracy, or R² for regression).

    The model files are fetched from the store again and verified against the manifest (the step
    folder ``evaluate`` scored), so this task may run on another worker than ``evaluate``."""
    from training.results import registry
    from training.checkpoint.export import EXPORTED
    from training.data.dataset import open_dataset
    from training.data.tokens import open_shards
    from training.evaluate import example_inputs, score_folder
    from training.checkpoint.commit import fetch_checkpoint
    from training.tracking.page import describe

    run_id = scored["mlflow_run_id"]
    name = params.get("registered_model") or params["experiment"]
    task = scored.get("task", "classification")
    metric = registry.gate_metric(params.get("gate_metric", "auto"), task)
    figures = scored.get("eval_metrics") or {"eval/loss": scored["eval_loss"], "eval/accuracy": scored["eval_accuracy"]}
    s3_env = store_env(params)
    data = (open_shards(scored["token_shards"], s3_env) if scored.get("token_shards")
            else open_dataset(scored["dataset_uri"], data_options(params), env=s3_env))
    settings.work_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.work_dir(), prefix="register-") as tmp:
        model_dir, _, _ = fetch_checkpoint(params["store_uri"], experiment=params["experiment"], run_id=run_id,
                                           dest=tmp, env=s3_env,
                                           step_dir=scored["evaluated_step_dir"],
                                           only=EXPORTED)
        gate = registry.register_and_gate(
            run_id=run_id, model_dir=model_dir, registered_model=name, metric_value=figures[metric], metric=metric,
            margin=float(params.get("promotion_margin", 0.0)), example_inputs=example_inputs(data),
            step=scored["eval_step"], data_fingerprint=scored.get("dataset_fingerprint"),
            score_model=lambda folder: score_folder(folder, data)[metric],
            flavour=params.get("registry_flavour", "auto"))
    log.info("registry: %s version %s is %s: %s", gate["registered_model"], gate["version"], gate["decision"], gate["reason"])
    describe(run_id)  # the decision and both aliases on the run's page
    return {**scored, "registry": gate}


@fails_fast
def report(params: dict[str, Any], registered: dict[str, Any], *, dag_run_start: datetime | None) -> dict[str, Any]:
    """Record how much of the DAG's wall time was orchestration, draw the run's plots, close the
    MLflow run and write its description (what its page shows first)."""
    from training.results.reports import run_plots
    from training.tracking.page import describe
    from training.tracking.run import run_url, summary_of

    run_id = registered["mlflow_run_id"]
    logger = run_logger(run_id)
    figures = {}
    if dag_run_start is not None:
        wall = (datetime.now(timezone.utc) - dag_run_start).total_seconds()
        figures = {"dag_wall_s": wall, "orchestration_overhead_s": wall - registered["torchrun_wall_s"]}
        logger.log_summary(figures)
    with tempfile.TemporaryDirectory(prefix="plots-") as tmp:
        if run_plots(logger.client, run_id, Path(tmp)):
            logger.client.log_artifacts(run_id, tmp, "plots")
    logger.finish("FINISHED")
    describe(run_id)
    summary = {**registered, **figures, "finished_unix": time.time()}
    log.info("run summary: %s", json.dumps(summary))
    run = logger.client.get_run(run_id)
    log.info("MLflow run page: %s", run_url(settings.mlflow_ui_url(), run.info.experiment_id, run_id))
    log.info("run summary figures: %s", json.dumps(summary_of(run), sort_keys=True))
    return summary
