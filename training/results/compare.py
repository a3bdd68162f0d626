"""Comparison report for MLflow runs: a table (Markdown + HTML) and PNG plots.

    python -m training compare --experiment distributed_training --last 5 --out var/reports/compare
    python -m training compare --experiment distributed_training --runs RUN_ID RUN_ID --out DIR

Reads through ``MlflowClient`` (any tracking URI) and writes into ``--out``: ``report.md`` /
``report.html`` (one row per run: the params that differ, throughput, communication per step,
evaluation, wall time, time to target), ``scaling.png`` (throughput and scaling efficiency: per-rank
throughput at N ranks over that at 1 rank of the same configuration), ``step_time.png`` (compute vs
communication), ``loss.png`` and, when runs recorded it, ``time_to_target.png``. Throughput and
communication are the median over a run's logged intervals (robust to the warm-up interval);
evaluation figures are the last logged values.
"""

from __future__ import annotations

import html
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.results.plots import figure, save
from training.tracking.run import summary_of

# (metric, column title, how a run's history becomes one number; "summary": a one-off figure of the
# run summary, training.tracking.run.summary_of)
KEY_METRICS = [
    ("perf/samples_per_s", "samples/s", "median"),
    ("perf/step_s", "step (ms)", "median"),
    ("comm/s_per_step", "comm (ms/step)", "median"),
    ("comm/exposed_fraction", "exposed comm", "median"),
    ("eval/accuracy", "eval accuracy", "last"),
    ("eval/loss", "eval loss", "last"),
    ("time_to_target_s", "time to target (s)", "summary"),
]
MS_METRICS = {"perf/step_s", "comm/s_per_step"}
# Params that differ between any two runs by construction (paths keyed by run id, hashes of
# the other params): listing them would hide the differences that matter.
NOISE_PARAMS = {"checkpoint_dir", "output_dir", "config_hash", "perf/peak_flops", "perf/peak_source"}
# Params that change how fast a step runs: runs that differ only in others (steps, seed, lr, ...)
# are the same configuration on the scaling plot.
THROUGHPUT_PARAMS = {"model", "strategy", "precision", "comm_hook", "batch_size", "grad_accum", "hidden", "depth",
                     "n_heads", "backend", "async_checkpoint"}


class CompareError(ValueError):
    """Bad input: an unknown experiment or run, or nothing to compare."""


@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    figures: dict[str, float | None]
    wall_s: float | None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def world_size(self) -> int | None:
        value = self.params.get("world_size") or self.tags.get("world_size")
        return int(value) if value else None


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def select_runs(client, experiment: str, *, run_ids: list[str] | None = None, last: int | None = None):
    """The runs to compare: the given ids, or the ``last`` finished runs of the experiment, oldest first."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise CompareError(f"experiment {experiment!r} does not exist in {_tracking_uri()}")
    if run_ids:
        runs = []
        for rid in run_ids:
            try:
                runs.append(client.get_run(rid))
            except MlflowException:
                raise CompareError(f"run {rid!r} does not exist in {_tracking_uri()}") from None
    else:
        runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=last or 10)
        runs = list(reversed(runs))
    if not runs:
        raise CompareError(f"experiment {experiment!r} has no finished runs to compare")
    return runs


def _tracking_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def _reduce(values: list[float], how: str) -> float | None:
    if not values:
        return None
    return statistics.median(values) if how == "median" else values[-1]


def summarize(client, runs) -> list[RunSummary]:
    out = []
    for run in runs:
        rid = run.info.run_id
        figures: dict[str, float | None] = {}
        summary = summary_of(run)
        for name, _, how in KEY_METRICS:
            if how == "summary":
                figures[name] = summary.get(name)
                continue
            if name not in run.data.metrics:
                figures[name] = None
                continue
            history = sorted(client.get_metric_history(rid, name), key=lambda m: (m.step, m.timestamp))
            figures[name] = _reduce([m.value for m in history], how)
        loss = sorted(client.get_metric_history(rid, "train/loss"), key=lambda m: m.step)
        wall = summary.get("dag_wall_s")
        if wall is None and run.info.end_time:
            wall = (run.info.end_time - run.info.start_time) / 1000
        out.append(RunSummary(run_id=rid, name=run.info.run_name or rid, status=run.info.status,
                              params=dict(run.data.params), tags=dict(run.data.tags), figures=figures, wall_s=wall,
                              loss_curve=[(m.step, m.value) for m in loss]))
    return out


def differing_params(summaries: list[RunSummary]) -> list[str]:
    keys = sorted(set().union(*(s.params for s in summaries)) - NOISE_PARAMS)
    differ = [k for k in keys if len({s.params.get(k) for s in summaries}) > 1]
    # world_size first: the axis of every scaling question
    return sorted(differ, key=lambda k: (k != "world_size", k))


def _label(s: RunSummary, keys: list[str]) -> str:
    shown = ", ".join(f"{k}={s.params.get(k, '-')}" for k in keys[:3])
    return f"{s.run_id[:8]}" + (f" ({shown})" if shown else "")


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name in MS_METRICS:
        return f"{value * 1000:.2f}"
    if name == "comm/exposed_fraction":
        return f"{value:.1%}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"


def table(summaries: list[RunSummary]) -> tuple[list[str], list[list[str]]]:
    keys = differing_params(summaries)
    metrics = [(n, t) for n, t, _ in KEY_METRICS if any(s.figures.get(n) is not None for s in summaries)]
    header = ["run", "name", *keys, *(t for _, t in metrics), "wall (s)"]
    rows = []
    for s in summaries:
        rows.append([s.run_id, s.name, *(s.params.get(k, "-") for k in keys),
                     *(_fmt(n, s.figures.get(n)) for n, _ in metrics),
                     "-" if s.wall_s is None else f"{s.wall_s:.1f}"])
    return header, rows


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---------------------------------------------------------------------------------- plots
def scaling_points(summaries: list[RunSummary]) -> dict[str, list[dict[str, float]]]:
    """Throughput and efficiency per world size, per configuration (the differing params other
    than world size). Efficiency = (throughput_N / N) / (throughput_1 / 1), means over repeats.

    The 1-rank baseline of a configuration ignores ``comm_hook``: on one rank there is nothing to
    compress, so a compressed 2-rank run is compared with the plain 1-rank run."""
    keys = [k for k in differing_params(summaries) if k in THROUGHPUT_PARAMS]
    groups: dict[str, dict[int, list[float]]] = {}
    baselines: dict[tuple, list[float]] = {}
    base_key: dict[str, tuple] = {}
    for s in summaries:
        thr = s.figures.get("perf/samples_per_s")
        if thr is None or s.world_size is None:
            continue
        name = ", ".join(f"{k}={s.params.get(k, '-')}" for k in keys) or "all runs"
        groups.setdefault(name, {}).setdefault(s.world_size, []).append(thr)
        base_key[name] = tuple(s.params.get(k) for k in keys if k != "comm_hook")
        if s.world_size == 1:
            baselines.setdefault(base_key[name], []).append(thr)
    out: dict[str, list[dict[str, float]]] = {}
    for name, by_ws in groups.items():
        base_runs = by_ws.get(1) or baselines.get(base_key[name])
        base = statistics.mean(base_runs) if base_runs else None
        out[name] = [{"world_size": ws, "samples_per_s": statistics.mean(v),
                      "efficiency": (statistics.mean(v) / ws) / base if base else float("nan")}
                     for ws, v in sorted(by_ws.items())]
    return out


def _plot_scaling(summaries: list[RunSummary], keys: list[str], path: Path) -> bool:
    groups = scaling_points(summaries)
    if not groups:
        return False
    fig, (ax1, ax2) = figure(11, 4.2, ncols=2)
    any_eff, top = False, 1.25
    for name, pts in groups.items():
        ws = [p["world_size"] for p in pts]
        ax1.plot(ws, [p["samples_per_s"] for p in pts], "o-", label=name)
        eff = [p["efficiency"] for p in pts]
        if any(e == e for e in eff):  # not all NaN: this group has a 1-rank baseline
            any_eff = True
            ax2.plot(ws, eff, "o-", label=name)
            top = max([top, *(1.1 * e for e in eff if e == e)])
    sizes = sorted({p["world_size"] for pts in groups.values() for p in pts})
    ax1.set(title="Throughput", xlabel="world size (ranks)", ylabel="samples / s (median over intervals)")
    ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal (linear scaling)")
    ax2.set(title="Scaling efficiency", xlabel="world size (ranks)",
            ylabel="per-rank throughput / per-rank at 1 rank", ylim=(0, top))
    if not any_eff:
        ax2.text(0.5, 0.5, "no world_size=1 run of the same configuration\nto compare against",
                 ha="center", va="center", transform=ax2.transAxes)
    for ax in (ax1, ax2):
        ax.set_xticks(sizes)
    ax1.set_ylim(bottom=0)
    return save(fig, path, (ax1, ax2))


def _plot_step_time(runs: list[RunSummary], keys: list[str], path: Path) -> bool:
    exposed_known = all(s.figures.get("comm/exposed_fraction") is not None for s in runs)
    labels, low, high = [], [], []
    for s in runs:
        step_ms = s.figures["perf/step_s"] * 1000
        if exposed_known:
            comm_ms = s.figures["comm/exposed_fraction"] * step_ms
        else:
            comm_ms = min(step_ms, (s.figures.get("comm/s_per_step") or 0.0) * 1000)
        labels.append(_label(s, keys))
        low.append(step_ms - comm_ms)
        high.append(comm_ms)
    if exposed_known:
        names = ("compute (and communication hidden behind it)", "exposed communication (step waited for it)")
        title = "Step time: compute vs exposed communication"
    else:
        names = ("rest of the step (step time - communication in flight)",
                 "gradient communication in flight (may overlap compute)")
        title = "Step time: communication in flight vs the rest (no exposed-time measurement logged)"
    fig, ax = figure(max(8, 1.3 * len(runs) + 3), 4.5)
    x = range(len(runs))
    ax.bar(x, low, label=names[0], color="#4C72B0")
    ax.bar(x, high, bottom=low, label=names[1], color="#DD8452")
    ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
    ax.set(title=title, ylabel="ms per optimizer step (median)")
    return save(fig, path, (ax,), grid="y")


def _plot_loss(runs: list[RunSummary], keys: list[str], path: Path) -> bool:
    fig, ax = figure(8, 4.5)
    for s in runs:
        steps, values = zip(*s.loss_curve)
        ax.plot(steps, values, label=_label(s, keys), linewidth=1.5)
    ax.set(title="Training loss", xlabel="optimizer step", ylabel="train/loss (cross-entropy, mean over interval)")
    return save(fig, path, (ax,))


def _plot_time_to_target(runs: list[RunSummary], keys: list[str], path: Path) -> bool:
    fig, ax = figure(max(6, 1.3 * len(runs) + 3), 4)
    ax.bar(range(len(runs)), [s.figures["time_to_target_s"] for s in runs], color="#55A868")
    ax.set_xticks(range(len(runs)), [_label(s, keys) for s in runs], rotation=20, ha="right", fontsize=8)
    ax.set(title="Time to reach the target metric", ylabel="seconds (wall clock)")
    return save(fig, path, (ax,), grid="y")


# Each plot: its file, which runs it draws (None: all), the function. Nothing to draw, no file.
PLOTS = (
    ("scaling.png", None, _plot_scaling),
    ("step_time.png", lambda s: s.figures.get("perf/step_s") is not None, _plot_step_time),
    ("loss.png", lambda s: bool(s.loss_curve), _plot_loss),
    ("time_to_target.png", lambda s: s.figures.get("time_to_target_s") is not None, _plot_time_to_target),
)


# ---------------------------------------------------------------------------------- report
def write_report(experiment: str, out: str | Path, *, run_ids: list[str] | None = None, last: int | None = None,
                 client=None) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    client = client or _client()
    summaries = summarize(client, select_runs(client, experiment, run_ids=run_ids, last=last))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    keys = differing_params(summaries)
    plots = {}
    for name, keep, make in PLOTS:
        runs = [s for s in summaries if keep is None or keep(s)]
        if runs and make(runs, keys, out / name):
            plots[name] = str(out / name)
    header, rows = table(summaries)
    intro = (f"Experiment `{experiment}`, {len(summaries)} runs (oldest first). Columns: the params that differ, "
             "then medians over logged intervals (throughput, step, communication) and last values (evaluation).")
    md = [f"# Run comparison: {experiment}", "", intro, "", _markdown(header, rows), ""]
    md += [f"![{name}]({name})" for name in plots]
    (out / "report.md").write_text("\n".join(md) + "\n")
    imgs = "".join(f'<p><img src="{html.escape(n)}" alt="{html.escape(n)}"></p>' for n in plots)
    (out / "report.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Run comparison</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f3f3f3}"
        f"</style></head><body><h1>Run comparison: {html.escape(experiment)}</h1><p>{html.escape(intro)}</p>"
        f"{_html_table(header, rows)}{imgs}</body></html>\n")
    (out / "runs.json").write_text(json.dumps([{"run_id": s.run_id, "name": s.name, "params": s.params,
                                                "figures": s.figures, "wall_s": s.wall_s} for s in summaries],
                                               indent=2) + "\n")
    return {"out": str(out), "runs": [s.run_id for s in summaries], "report_md": str(out / "report.md"),
            "report_html": str(out / "report.html"), "plots": plots}
