"""The MLflow run's status follows its DAG run: every failure leaves a true record in it.

Task callbacks (``default_args`` of the training DAGs): ``on_retry`` and ``on_failure`` tag
``failure.task``, ``failure.try`` and ``failure.reason`` and log the task's log tail as
``failures/<task>-try<N>.log``; ``on_failure`` also marks the run FAILED (during a retry it stays
RUNNING). ``on_success`` after a failure removes the ``failure.*`` tags and puts a FAILED run back
to RUNNING. Cancellations get no callback in Airflow, so ``reconcile`` (called by ``open_run``)
marks the RUNNING MLflow runs whose DAG run failed or no longer exists KILLED.

A callback never raises (a record about a failure must not hide it) and finds the MLflow run by
its tags (``airflow.dag_id``, ``airflow.dag_run_id``), so it also works where the task's process is gone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from training_airflow import settings

log = logging.getLogger(__name__)
TAIL_LINES = 200


def _run_of(context: dict[str, Any]):
    """(client, run) of this DAG run's MLflow run, or (client, None) before it was opened."""
    settings.ensure_tracking_uri()
    from mlflow.tracking import MlflowClient

    from training.tracking.run import find_runs

    client = MlflowClient()
    exp = client.get_experiment_by_name(context["params"]["experiment"])
    if exp is None:
        return client, None
    ti = context["ti"]
    found = find_runs(exp.experiment_id, dag_id=ti.dag_id, dag_run_id=ti.run_id)
    return client, (found[0] if found else None)


def reason_of(exception: BaseException | str | None) -> str:
    """One line a person can act on: the exception's own ``reason`` if it has one, else its first line
    (with the lines it introduces when it ends with a colon)."""
    if exception is None:
        return "the task failed without an error from its process (killed, lost its worker, or timed out)"
    if isinstance(exception, str):
        text = exception
    else:
        text = getattr(exception, "reason", None) or f"{type(exception).__name__}: {exception}"
    lines = [line.strip() for line in str(text).splitlines() if line.strip()] or [str(text)]
    # A heading that ends with ':' says nothing without what follows it ("data validation failed
    # for ...:" then one line per failed expectation): keep the lines it introduces.
    first = lines[0] if not lines[0].endswith(":") else f"{lines[0]} " + "; ".join(l.lstrip("- ") for l in lines[1:4])
    return first[:500]


def log_tail(ti: Any, lines: int = TAIL_LINES) -> str | None:
    """The last lines of the task's log file (Airflow's default file layout), as readable text."""
    from airflow.configuration import conf

    folder = Path(conf.get("logging", "base_log_folder"))
    path = folder / f"dag_id={ti.dag_id}" / f"run_id={ti.run_id}" / f"task_id={ti.task_id}" / f"attempt={ti.try_number}.log"
    if not path.is_file():
        return None
    out = []
    for raw in path.read_text(errors="replace").splitlines()[-lines:]:
        try:
            rec = json.loads(raw)
            out.append(f"{rec.get('timestamp', '')} {rec.get('level', '')} {rec.get('logger', '')}: {rec.get('event', '')}")
        except (ValueError, AttributeError):
            out.append(raw)
    return "\n".join(out) + "\n"


def _record(context: dict[str, Any], *, final: bool) -> None:
    client, run = _run_of(context)
    if run is None:
        return  # the task failed before the run was opened (bad Params): nothing to record in
    ti = context["ti"]
    reason = reason_of(context.get("exception"))
    from mlflow.entities import RunTag

    from training.tracking.page import describe

    tags = {"failure.task": ti.task_id, "failure.try": str(ti.try_number), "failure.reason": reason}
    client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    # The task's log file; where there is none (dag.test writes none), the output the task kept.
    tail = log_tail(ti) or getattr(context.get("exception"), "tail", None)
    if tail is not None:
        client.log_text(run.info.run_id, tail, f"failures/{ti.task_id}-try{ti.try_number}.log")
    if final:
        client.set_terminated(run.info.run_id, "FAILED")
    describe(run.info.run_id)  # the reason on the first thing the run's page shows
    log.info("MLflow run %s: %s try %s failed (%s)%s", run.info.run_id, ti.task_id, ti.try_number, reason,
             ", marked FAILED" if final else ", a retry follows")


def _safely(fn, context: dict[str, Any], **kwargs: Any) -> None:
    try:
        fn(context, **kwargs)
    except Exception as e:  # never hide the task's own failure behind ours
        log.warning("could not update the MLflow run's record: %s: %s", type(e).__name__, e)


def on_failure(context: dict[str, Any]) -> None:
    _safely(_record, context, final=True)


def on_retry(context: dict[str, Any]) -> None:
    _safely(_record, context, final=False)


def _recovered(context: dict[str, Any]) -> None:
    from training.tracking.page import describe

    client, run = _run_of(context)
    if run is None or "failure.task" not in run.data.tags:
        return
    for key in [k for k in run.data.tags if k.startswith("failure.")]:  # the launcher's rank tags too
        client.delete_tag(run.info.run_id, key)
    if run.info.status == "FAILED":
        client.update_run(run.info.run_id, status="RUNNING")
    describe(run.info.run_id)
    log.info("MLflow run %s: %s succeeded after the failure of %s; failure tags removed", run.info.run_id,
             context["ti"].task_id, run.data.tags["failure.task"])


def on_success(context: dict[str, Any]) -> None:
    _safely(_recovered, context)


def reconcile(experiment_id: str, *, dag_id: str, current_run_id: str) -> list[str]:
    """Mark KILLED the RUNNING MLflow runs of ``dag_id`` whose DAG run failed or was deleted.
    Runs inside a task (it asks the Airflow API server for the DAG runs' states)."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    from training.tracking.page import describe
    from training.tracking.run import TAG_DAG_RUN_ID, find_runs

    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        state_of = RuntimeTaskInstance.get_dagrun_state
    except ImportError:  # pragma: no cover - an Airflow without the Task SDK call
        return []
    client, killed = MlflowClient(), []
    for run in find_runs(experiment_id, dag_id=dag_id, status="RUNNING"):
        dag_run_id = run.data.tags.get(TAG_DAG_RUN_ID)
        if not dag_run_id or dag_run_id == current_run_id:
            continue
        try:
            state = str(state_of(dag_id, dag_run_id))
        except Exception as e:  # the API answers an error for a DAG run that no longer exists
            text = str(e).lower().replace("_", " ")
            if "not found" not in text and "404" not in text:
                log.warning("state of DAG run %s unknown (%s); MLflow run %s left as it is", dag_run_id, e, run.info.run_id)
                continue
            state = "deleted"
        if state.rsplit(".", 1)[-1].lower() not in ("failed", "deleted"):
            continue
        why = ("the DAG run was deleted" if state == "deleted" else
               "the DAG run ended failed with no task failure recorded here (marked failed in the UI, or killed)")
        client.log_batch(run.info.run_id, tags=[RunTag("failure.reason", f"cancelled: {why}")])
        client.set_terminated(run.info.run_id, "KILLED")
        describe(run.info.run_id)
        killed.append(run.info.run_id)
        log.info("MLflow run %s of DAG run %s marked KILLED: %s", run.info.run_id, dag_run_id, why)
    return killed
