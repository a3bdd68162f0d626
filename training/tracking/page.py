"""The run's page: its description (``mlflow.note.content``, markdown), written from what the
run holds whenever the story changes, and the ``progress`` tag's text."""

from __future__ import annotations

from pathlib import Path

from training.tracking.run import (TAG_AIRFLOW_NOTE, TAG_AIRFLOW_URL, TAG_DAG_ID, TAG_DAG_RUN_ID, TAG_NOTE, TAG_PROGRESS,
                                   _client, summary_of)


def _fmt_figure(value: float | None, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "ms":
        return f"{1000 * value:.1f}"
    if kind == "%":
        return f"{100 * value:.1f}%"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"


def _median(client, run_id: str, key: str) -> float | None:
    import statistics

    values = [m.value for m in client.get_metric_history(run_id, key)]
    return statistics.median(values) if values else None


def describe(run_id: str) -> str:
    """Write the run's description (``mlflow.note.content``, markdown) from what the run holds now,
    and return it. Called whenever the story changes: opened, failed, registered, finished."""
    client = _client()
    run = client.get_run(run_id)
    tags, metrics, summary = run.data.tags, run.data.metrics, summary_of(run)
    lines = []
    status = run.info.status
    what = ", ".join(v for v in (tags.get("model"), tags.get("strategy"), tags.get("precision")) if v)
    where = (f" on {tags['world_size']} rank{'' if tags['world_size'] == '1' else 's'}" if tags.get("world_size") else "")
    lines.append(f"**{status}** {what}{where}" + (f" · {tags[TAG_PROGRESS]}" if tags.get(TAG_PROGRESS) else ""))
    if "failure.reason" in tags:  # what went wrong first
        at = f"`{tags['failure.task']}` try {tags.get('failure.try', '?')}: " if "failure.task" in tags else ""
        label = "Failed" if status in ("FAILED", "KILLED") else "Failed, a retry follows"
        lines.append(f"**{label}:** {at}{tags['failure.reason']}")
    if tags.get(TAG_AIRFLOW_URL):
        lines.append(f"**Airflow run:** [{tags.get(TAG_DAG_ID, '')} / {tags.get(TAG_DAG_RUN_ID, '')}]"
                     f"({tags[TAG_AIRFLOW_URL]})")
    if tags.get("policy.runtime"):  # who asked for the run, and under which of the deployment's rules
        lines.append(f"**Triggered by:** {tags.get('airflow.triggered_by', '?')} · **runtime** `{tags['policy.runtime']}` "
                     f"· **policy** `{tags.get('policy.source', '?')}` sha256 `{tags.get('policy.sha256', '')[:12]}`")
    if tags.get(TAG_AIRFLOW_NOTE):
        lines.append("**Airflow note:** " + tags[TAG_AIRFLOW_NOTE].replace("\n", " "))
    figures = [("eval accuracy", metrics.get("eval/accuracy"), ""), ("eval loss", metrics.get("eval/loss"), ""),
               ("train loss", metrics.get("train/loss"), ""),
               ("samples/s", _median(client, run_id, "perf/samples_per_s"), ""),
               ("step (ms)", _median(client, run_id, "perf/step_s"), "ms"),
               ("exposed comm", _median(client, run_id, "comm/exposed_fraction"), "%"),
               ("goodput", summary.get("goodput"), "%"), ("DAG wall (s)", summary.get("dag_wall_s"), "")]
    shown = [(name, _fmt_figure(v, kind)) for name, v, kind in figures if v is not None]
    if shown:
        lines.append("| " + " | ".join(n for n, _ in shown) + " |\n|" + "---|" * len(shown) + "\n| "
                     + " | ".join(v for _, v in shown) + " |")
    plots = [a.path for a in client.list_artifacts(run_id, "plots") if a.path.endswith(".png")]
    if plots:  # relative to the UI's own address, so the images show wherever the UI is served
        lines.append(" ".join(f"![{Path(p).stem}](get-artifact?path={p}&run_uuid={run_id})" for p in sorted(plots)))
    if tags.get("registry.decision"):
        lines.append(f"**Registry:** `{tags.get('registry.model')}` version {tags.get('registry.version')} is "
                     f"**{tags['registry.decision']}**: {tags.get('registry.reason', '')}"
                     + (f"\n\nAliases now: {tags['registry.aliases']}" if tags.get("registry.aliases") else ""))
    if tags.get("data.fingerprint"):
        rows = ", ".join(f"{v} {k.removeprefix('data.rows_')}" for k, v in sorted(tags.items()) if k.startswith("data.rows_"))
        lines.append(f"**Data:** `{tags.get('dataset_uri', '')}` ({rows} rows), fingerprint "
                     f"`{tags['data.fingerprint'][:16]}`, gate {tags.get('data.validation', '?')} (`data_gate.html`)")
    note = "\n\n".join(lines) + "\n"
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(TAG_NOTE, note)])
    return note
