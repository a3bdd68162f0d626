"""MLflow logging: one run per DAG run, written through ``MlflowClient`` (no global active run).

``open_run`` returns the run of a DAG run (found by its ``airflow.*`` tags, so a retry re-opens it);
the run id travels as ``MLFLOW_RUN_ID``, the store as ``MLFLOW_TRACKING_URI``. ``RunLogger`` is rank
0's logger: params, metrics (``OnceLogger``: each step once, whatever restarts replay), tags,
artifacts, the ``progress`` tag, ``log_dataset``, and ``log_summary`` for one-off figures
(``summary.json``; the headline ones also one-value metrics and ``summary.<name>`` tags). Other
ranks, and a process without a run id, get ``NullLogger`` (same methods; see relay.py's ``logger_for``).
The experiment opens on its runs table with a shared view (``TRAINING_VIEW``, ``run_url``).
Why rank 0 may relay its calls instead: docs/decisions/0006-relay-rank0-mlflow-over-stdout.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# Reading the run summary back downloads an artifact; MLflow's progress bar for that is noise in
# every task log (carriage returns in a file).
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

TAG_DAG_ID = "airflow.dag_id"
TAG_DAG_RUN_ID = "airflow.dag_run_id"
TAG_AIRFLOW_URL = "airflow.url"
TAG_AIRFLOW_NOTE = "airflow.note"
TAG_PROGRESS = "progress"
TAG_NOTE = "mlflow.note.content"
SUMMARY_PREFIX = "summary."
SUMMARY_FILE = "summary.json"
# The headline one-off figures: also metrics of one value (so runs sort, filter and plot by them:
# metrics.time_to_target_s < 60) and tags summary.<name> (older readers). All are in the file.
SUMMARY_TAGS = frozenset({"goodput", "train_wall_s", "lost_to_restarts_s", "device_hours", "peak_mem_bytes_max",
                          "state_bytes_per_rank", "time_to_target_s", "steps_to_target", "warmup_step_s",
                          "torchrun_wall_s", "upload_s", "dag_wall_s", "orchestration_overhead_s"})
# MLflow 3's UI opens a "custom model development" experiment on its runs table, not on the GenAI
# trace overview it shows for an experiment of unknown kind.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# A view of the runs table stored in the experiment (MLflow's "share view" tags): the URLs below
# open it, so a person lands on the runs with their loss, evaluation and throughput side by side.
VIEW_KEY = "training"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_COLUMNS = ("metrics.`eval/accuracy`", "metrics.`eval/loss`", "metrics.`train/loss`",
                "metrics.`perf/samples_per_s`", "tags.`world_size`", "tags.`progress`", "attributes.`Dataset`",
                "attributes.`Models`")
TRAINING_VIEW = {"selectedColumns": list(VIEW_COLUMNS), "orderByKey": "attributes.start_time", "orderByAsc": False}


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def default_artifact_location(tracking_uri: str) -> str | None:
    """For a local SQLite store keep artifacts next to the database, not in the process's cwd."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        if not db.is_absolute():
            db = Path.cwd() / db
        return (db.parent / "artifacts").as_uri()
    return None


def get_or_create_experiment(name: str) -> str:
    import mlflow

    client = _client()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            client.create_experiment(name, artifact_location=default_artifact_location(mlflow.get_tracking_uri()))
        except Exception:  # another process created it between our two calls
            pass
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise RuntimeError(f"MLflow experiment {name!r} could not be created in {mlflow.get_tracking_uri()}")
    view = json.dumps(TRAINING_VIEW)
    for key, value in (EXPERIMENT_KIND, (VIEW_TAG, view)):
        if exp.tags.get(key) != value:
            client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def experiment_url(ui: str, experiment_id: str) -> str:
    """The experiment's runs table in the model-training view, with the ``training`` columns."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def run_url(ui: str, experiment_id: str, run_id: str) -> str:
    """The run's page (its description, figures and plots first)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def compare_url(ui: str, experiment_id: str, run_ids: list[str]) -> str:
    """MLflow's compare view of ``run_ids`` (parameters side by side, a parallel-coordinates plot)."""
    return (f"{ui.rstrip('/')}/#/compare-runs?runs={json.dumps(run_ids)}&experiments={json.dumps([experiment_id])}"
            "&workflowType=machine_learning")


def open_run(experiment: str, *, dag_id: str, dag_run_id: str, run_name: str | None = None,
             tags: dict[str, str] | None = None) -> str:
    """Return the MLflow run of this DAG run, creating it the first time only.

    Keyed by the ``airflow.dag_run_id`` tag, so a retried task (or a re-run of the first task)
    finds the same run instead of opening a second one.
    """
    client = _client()
    exp_id = get_or_create_experiment(experiment)
    found = find_runs(exp_id, dag_id=dag_id, dag_run_id=dag_run_id)
    if found:
        return found[0].info.run_id
    run = client.create_run(exp_id, run_name=run_name, tags={TAG_DAG_ID: dag_id, TAG_DAG_RUN_ID: dag_run_id, **(tags or {})})
    return run.info.run_id


def find_runs(experiment_id: str, *, dag_id: str, dag_run_id: str | None = None, status: str | None = None) -> list:
    """MLflow runs of a DAG (and of one of its DAG runs, and in one status, when given)."""
    def quoted(v: str) -> str:
        return "'" + v.replace("'", "") + "'"

    terms = [f"tags.`{TAG_DAG_ID}` = {quoted(dag_id)}"]
    if dag_run_id is not None:
        terms.append(f"tags.`{TAG_DAG_RUN_ID}` = {quoted(dag_run_id)}")
    if status is not None:
        terms.append(f"attributes.status = {quoted(status)}")
    return _client().search_runs([experiment_id], filter_string=" and ".join(terms), max_results=1000)


class RunLogger:
    """Logs to one existing MLflow run."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.client = _client()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # JSON for objects (model_args, dict Params), so a param reads back as what was set.
        items = [Param(k, (json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v))[:6000])
                 for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def log_metrics_once(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Like ``log_metrics``, but skip every metric that already has a value at ``step``: a
        retried or cleared task then leaves one point per step, not two. Returns what it logged."""
        new = {k: v for k, v in metrics.items()
               if not any(m.step == step for m in self.client.get_metric_history(self.run_id, k))}
        if new:
            self.log_metrics(new, step=step)
        return new

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_summary(self, figures: dict[str, float]) -> None:
        """One-off figures of the run: all of them in ``summary.json`` (a later call adds to it, a
        repeated one overwrites); the headline ones (``SUMMARY_TAGS``) also as a metric of one value
        (step 0; a task that logs it again, retried or cleared, logs the newer value at the next
        step, which MLflow then shows: never two points at one step) and as a tag ``summary.<name>``."""
        if not figures:
            return
        merged = {**read_summary(self.run_id, self.client), **{k: float(v) for k, v in figures.items()}}
        self.log_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", SUMMARY_FILE)
        headline = {k: float(v) for k, v in figures.items() if k in SUMMARY_TAGS}
        if headline:
            for k, v in headline.items():
                self.log_metrics({k: v}, step=len(self.client.get_metric_history(self.run_id, k)))
            self.set_tags({SUMMARY_PREFIX + k: f"{v:.8g}" for k, v in headline.items()})

    def set_progress(self, step: int, total: int, eta_s: float | None) -> None:
        self.set_tags({TAG_PROGRESS: progress_text(step, total, eta_s)})

    def log_dataset(self, name: str, *, uri: str, fingerprint: str, schema: dict[str, Any],
                    rows: dict[str, int], context: str = "training") -> None:
        """The data as an MLflow dataset input: the runs table's Dataset column shows its name and
        fingerprint, the run page its schema and rows. Logged once per run (a retry adds nothing)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = self.client.get_run(self.run_id).inputs
        if any(d.dataset.digest == fingerprint[:32] for d in (inputs.dataset_inputs if inputs else [])):
            return
        types = {"float": "double", "int": "long", "bool": "boolean", "string": "string"}
        colspec = [{"type": types.get(c.get("dtype", "float"), "string"), "name": c["name"],
                    "required": not c.get("nullable", False)} for c in schema.get("columns", [])]
        source = {"uri": uri} if "://" in uri else {"uri": Path(uri).resolve().as_uri()}
        dataset = Dataset(name=name, digest=fingerprint[:32], source_type="local" if uri.startswith(("/", "file:")) else "url",
                          source=json.dumps(source), schema=json.dumps({"mlflow_colspec": colspec}),
                          profile=json.dumps({"fingerprint": fingerprint, "kind": schema.get("kind"),
                                              "label": schema.get("label"), **{f"rows_{k}": v for k, v in rows.items()}}))
        self.client.log_inputs(self.run_id, [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])])

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)


class NullLogger:
    """Same methods as RunLogger, does nothing: for ranks other than 0 and runs without MLflow."""

    run_id = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_metrics_once(self, metrics: dict[str, float], step: int) -> dict[str, float]: return {}
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_summary(self, figures: dict[str, float]) -> None: ...
    def set_progress(self, step: int, total: int, eta_s: float | None) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


# ------------------------------------------------------------------------------ what a person reads


def read_summary(run_id: str, client=None) -> dict[str, float]:
    """Every one-off figure of the run (``summary.json``); {} before the first."""
    import tempfile

    client = client or _client()
    with tempfile.TemporaryDirectory(prefix="summary-") as tmp:
        try:
            return json.loads(Path(client.download_artifacts(run_id, SUMMARY_FILE, tmp)).read_text())
        except Exception:  # no summary yet
            return {}


def summary_of(run) -> dict[str, float]:
    """The run's headline one-off figures (the ``summary.<name>`` tags), by name."""
    out = {}
    for key, value in run.data.tags.items():
        if key.startswith(SUMMARY_PREFIX):
            try:
                out[key[len(SUMMARY_PREFIX):]] = float(value)
            except ValueError:
                continue
    return out


class OnceLogger:
    """Logs a metric at a step only if the run has no value of it at that step yet.

    A restarted group (torchrun --max-restarts) or a retried task replays the steps after the
    latest checkpoint; they would otherwise appear twice in the run. The steps already in the run
    are read once per metric key (one query per key, not per log call, so logging stays cheap),
    then tracked here. ``RunLogger.log_metrics_once`` does the same per call, for rare metrics.
    """

    def __init__(self, logger) -> None:
        self.logger = logger
        self._seen: dict[str, set[int]] = {}

    def _steps(self, key: str) -> set[int]:
        if key not in self._seen:
            client = getattr(self.logger, "client", None)
            self._seen[key] = ({m.step for m in client.get_metric_history(self.logger.run_id, key)}
                               if client is not None else set())
        return self._seen[key]

    def log_metrics(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        if getattr(self.logger, "skips_logged_steps", False):  # relay.RelayLogger: the receiving end reads the run
            self.logger.log_metrics_once(metrics, step=step)
            return metrics
        new = {k: v for k, v in metrics.items() if step not in self._steps(k)}
        if new:
            self.logger.log_metrics(new, step=step)
            for k in new:
                self._seen[k].add(step)
        return new


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def progress_text(step: int, total: int, eta_s: float | None) -> str:
    """``120/300 steps (40%), ETA 1m12s``; at the end ``300/300 steps (100%)``."""
    pct = 100 * step // max(1, total)
    eta = f", ETA {_duration(eta_s)}" if eta_s is not None and step < total else ""
    return f"{step}/{total} steps ({pct}%){eta}"
