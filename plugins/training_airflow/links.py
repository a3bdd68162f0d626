"""The two runs of one training, linked both ways.

- Airflow -> MLflow: ``MLflowRunLink``, the extra link "MLflow run" on every task, whatever its
  state (registered by ``plugins/training_links.py`` as a global operator link); it finds the MLflow
  run by the tags ``airflow.dag_id`` and ``airflow.dag_run_id``; a DAG run without one gets no link.
- MLflow -> Airflow: ``airflow_tags`` (the DAG run's page as ``airflow.url``, and the run type), set
  by ``open_run``; ``RunNoteListener`` (in the scheduler) copies the DAG run's note into the tag
  ``airflow.note`` when the run ends, for the MLflow run's description (training/tracking/page.py).
  Tasks cannot read the note: Airflow's execution API hands them the DAG run without it.

The UIs' addresses: ``settings.airflow_ui_url`` and ``settings.mlflow_ui_url``. Light imports only:
the plugin loader of every Airflow part imports this.
"""

from __future__ import annotations

import functools
import logging
from typing import Any
from urllib.parse import quote

from airflow.listeners import hookimpl
from airflow.sdk import BaseOperatorLink

from training_airflow import settings

log = logging.getLogger(__name__)


def airflow_run_url(dag_id: str, dag_run_id: str) -> str:
    """The DAG run's page in the Airflow UI (its grid, tasks, logs)."""
    return f"{settings.airflow_ui_url()}/dags/{quote(dag_id, safe='')}/runs/{quote(dag_run_id, safe='')}"


def airflow_tags(dag_run: Any) -> dict[str, str]:
    """What the MLflow run says about its Airflow run (``dag_run``: the task context's)."""
    return {"airflow.url": airflow_run_url(dag_run.dag_id, dag_run.run_id),
            "airflow.run_type": str(getattr(dag_run, "run_type", "") or "").rsplit(".", 1)[-1].lower()}


@functools.lru_cache(maxsize=4096)
def _found(dag_id: str, dag_run_id: str) -> tuple[str, str]:
    """(experiment id, run id) of the DAG run's MLflow run; raises LookupError while there is none
    (not cached then: the run may be opened a moment later)."""
    settings.ensure_tracking_uri()
    from mlflow.tracking import MlflowClient

    from training.tracking.run import TAG_DAG_ID, TAG_DAG_RUN_ID

    client = MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    quoted = lambda v: "'" + v.replace("'", "") + "'"  # noqa: E731
    runs = client.search_runs(experiments, max_results=1, filter_string=(
        f"tags.`{TAG_DAG_ID}` = {quoted(dag_id)} and tags.`{TAG_DAG_RUN_ID}` = {quoted(dag_run_id)}")) if experiments else []
    if not runs:
        raise LookupError(f"no MLflow run for {dag_id}/{dag_run_id}")
    return runs[0].info.experiment_id, runs[0].info.run_id


def mlflow_run_page(dag_id: str, dag_run_id: str) -> str | None:
    """The MLflow run page of a DAG run, or None when it has no MLflow run."""
    from training.tracking.run import run_url

    try:
        experiment_id, run_id = _found(dag_id, dag_run_id)
    except LookupError:
        return None
    return run_url(settings.mlflow_ui_url(), experiment_id, run_id)


class MLflowRunLink(BaseOperatorLink):
    """The button "MLflow run" on every task: the page of the MLflow run of the task's DAG run."""

    name = "MLflow run"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        try:
            return mlflow_run_page(ti_key.dag_id, ti_key.run_id) or ""
        except Exception as e:  # a link must never break the page it is on
            log.warning("MLflow run link of %s/%s: %s", ti_key.dag_id, ti_key.run_id, e)
            return ""


def copy_note(dag_run: Any) -> bool:
    """The DAG run's note into its MLflow run (tag ``airflow.note`` and the description); True when
    it changed something. ``dag_run``: the scheduler's DagRun, which has the note."""
    from sqlalchemy.orm.exc import DetachedInstanceError

    try:
        note = (getattr(dag_run, "note", None) or "").strip()[:1000]  # the description holds it too
    except DetachedInstanceError:  # dag.test()'s run, outside its session at the end: nobody wrote a note
        return False
    if not note:
        return False
    try:
        _, run_id = _found(dag_run.dag_id, dag_run.run_id)
    except LookupError:
        return False
    from mlflow.tracking import MlflowClient

    from training.tracking.page import describe
    from training.tracking.run import TAG_AIRFLOW_NOTE

    client = MlflowClient()
    if client.get_run(run_id).data.tags.get(TAG_AIRFLOW_NOTE) == note:
        return False
    client.set_tag(run_id, TAG_AIRFLOW_NOTE, note)
    describe(run_id)
    return True


class RunNoteListener:
    """Scheduler-side: when a DAG run ends, its note goes into its MLflow run."""

    def _copy(self, dag_run: Any) -> None:
        try:
            copy_note(dag_run)
        except Exception as e:  # never disturb the scheduler for a note
            log.warning("note of %s/%s not copied to MLflow: %s", dag_run.dag_id, dag_run.run_id, e)

    @hookimpl
    def on_dag_run_success(self, dag_run: Any, msg: str) -> None:
        self._copy(dag_run)

    @hookimpl
    def on_dag_run_failed(self, dag_run: Any, msg: str) -> None:
        self._copy(dag_run)
