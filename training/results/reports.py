"""The pages and pictures each MLflow run carries beside its metrics, for a person reading the run:

- ``data_gate_page``: the data gate's verdict on one self-contained HTML page (``data_gate.html``,
  beside GX's Data Docs, whose pages render unstyled in MLflow's artifact viewer);
- ``evaluation_report`` / ``evaluation_files``: the final model's evaluation by the dataset's task
  (classification: per-class precision, recall, F1 and a confusion matrix), under ``evaluation/``;
- ``run_plots``: the run's curves as PNGs under ``plots/`` (loss and evaluation; throughput and the
  step time split into compute and exposed communication), with the figure set-up of
  training/results/compare.py.

Plain HTML with inline styles (no scripts, no external files): MLflow's viewer shows it as is.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Callable

STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}h1{font-size:1.4em}h2{font-size:1.1em;"
         "margin-top:1.5em}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
         "text-align:left}th{background:#f3f3f3}.ok{color:#1a7f37;font-weight:bold}.bad{color:#cf222e;"
         "font-weight:bold}code{background:#f6f8fa;padding:1px 4px}")


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---------------------------------------------------------------------------------- data gate


def data_gate_page(report: dict[str, Any]) -> str:
    """The data gate's verdict on one page (``report``: training.data.gate.validate's)."""
    ok = report.get("success")
    verdict = '<p class="ok">PASSED</p>' if ok else f'<p class="bad">FAILED: {len(report["failures"])} expectations</p>'
    parts = [verdict, f"<p>Dataset <code>{html.escape(str(report.get('dataset_uri', '')))}</code>, fingerprint "
                      f"<code>{html.escape(str(report.get('fingerprint') or '-'))}</code></p>"]
    if report.get("rows"):
        parts.append("<h2>Rows</h2>" + _table(["split", "rows"], sorted(report["rows"].items())))
    if report.get("failures"):
        parts.append("<h2>Failed expectations</h2><ul>"
                     + "".join(f"<li><code>{html.escape(f)}</code></li>" for f in report["failures"]) + "</ul>")
    schema = report.get("schema") or {}
    if schema.get("columns"):
        rows = [[c["name"], c.get("dtype", ""), c.get("min", ""), c.get("max", ""),
                 ", ".join(map(str, c["values"])) if c.get("values") else "", "yes" if c.get("nullable") else "no"]
                for c in schema["columns"]]
        rules = {k: v for k, v in schema.items() if k not in ("columns", "kind") and v is not None}
        parts.append(f"<h2>Schema ({html.escape(str(schema.get('kind', '')))})</h2>"
                     + _table(["column", "dtype", "min", "max", "allowed values", "nulls allowed"], rows)
                     + _table(["rule", "value"], sorted((k, json.dumps(v)) for k, v in rules.items())))
    if report.get("files"):
        files = report["files"]
        items = files.items() if isinstance(files, dict) else ((f.get("path"), f) for f in files)
        rows = [[path, (f or {}).get("size", ""), str((f or {}).get("sha256", ""))[:16]] for path, f in items]
        parts.append("<h2>Files</h2>" + _table(["file", "bytes", "sha256 (first 16)"], rows))
    parts.append("<p>Great Expectations' own pages: <code>data_docs/index.html</code>; the verdict as data: "
                 "<code>data_validation.json</code>.</p>")
    return _page("Data gate", "".join(parts))


# ---------------------------------------------------------------------------------- evaluation


def _confusion(model, kind: str, batches):
    """The confusion matrix (rows: true class, columns: predicted) over every scored position of
    ``batches`` ((features, labels | None) tensors), counted batch by batch."""
    import torch

    from training.models.loss import split_batch

    confusion = None
    model.eval()
    with torch.no_grad():
        for features, labels in batches:
            inputs, target = split_batch(kind, features, labels)
            logits = model(inputs)
            n = logits.shape[-1]
            part = torch.bincount(target.reshape(-1) * n + logits.argmax(dim=-1).reshape(-1), minlength=n * n)
            confusion = part if confusion is None else confusion + part
    return confusion.reshape(n, n)


def classification_report(model, kind: str, batches) -> dict[str, Any]:
    """Per-class precision, recall, F1 and support, and the confusion matrix (rows: true class,
    columns: predicted), over the validation split (``batches``: its rows, a batch at a time)."""
    import torch

    confusion = _confusion(model, kind, batches)
    n, rows = len(confusion), int(confusion.sum())
    tp = confusion.diag().double()
    predicted, support = confusion.sum(0).double(), confusion.sum(1).double()
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(support > 0, tp / support.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12),
                     torch.zeros_like(tp))
    classes = [{"class": c, "precision": float(precision[c]), "recall": float(recall[c]), "f1": float(f1[c]),
                "support": int(support[c])} for c in range(n) if support[c] > 0 or predicted[c] > 0]
    present = [c for c in classes if c["support"] > 0]
    return {"task": "classification", "rows": rows, "accuracy": float(tp.sum() / rows),
            "macro_f1": sum(c["f1"] for c in present) / max(1, len(present)), "classes": classes,
            "confusion_matrix": confusion.tolist()}


def regression_report(model, kind: str, batches) -> dict[str, Any]:
    """Residuals (label - prediction, in the label's units) over the validation split (``batches``:
    its rows, a batch at a time): RMSE, MAE, R², the residuals' quantiles, and up to 2,000
    (prediction, residual) points for the plot."""
    import torch

    model.eval()
    preds, trues = [], []
    with torch.no_grad():
        for features, labels in batches:
            preds.append(model(features).reshape(-1).double())
            trues.append(labels.reshape(-1).double())
    pred, true = torch.cat(preds), torch.cat(trues)
    residual = true - pred
    total = ((true - true.mean()) ** 2).sum()
    quantiles = torch.quantile(residual, torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64))
    every = max(1, len(pred) // 2000)
    return {"task": "regression", "rows": int(true.numel()), "rmse": float(residual.pow(2).mean().sqrt()),
            "mae": float(residual.abs().mean()), "r2": float(1 - residual.pow(2).sum() / total) if total > 0 else None,
            "residual_quantiles": dict(zip(("p05", "p25", "p50", "p75", "p95"), quantiles.tolist())),
            "points": [[float(a), float(b)] for a, b in zip(pred[::every], residual[::every])]}


# The evaluation report of each task: what a person checks for that kind of model.
EVALUATION_REPORTS: dict[str, Callable[..., dict[str, Any]]] = {"classification": classification_report,
                                                                "regression": regression_report}


def evaluation_report(task: str, kind: str, model, batches) -> dict[str, Any] | None:
    """The report for the model's task (``classification`` or ``regression``) on its kind of data;
    ``batches``: the validation rows as (features, labels) tensors, a batch at a time (read only
    when the task has a report)."""
    make = EVALUATION_REPORTS.get(task)
    return make(model, kind, batches) if make else None


def _confusion_png(report: dict[str, Any], path: Path) -> None:
    from training.results.plots import figure, save

    matrix = report["confusion_matrix"]
    n = len(matrix)
    fig, ax = figure(min(9, 2.5 + 0.45 * n), min(8, 2 + 0.4 * n))
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046)
    if n <= 20:
        top = max(max(r) for r in matrix) or 1
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                ax.text(j, i, str(v), ha="center", va="center", fontsize=8, color="white" if v > top / 2 else "black")
    ticks = range(0, n, max(1, n // 20))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set(title="Confusion matrix (validation)", xlabel="predicted class", ylabel="true class")
    save(fig, path)


def _residuals_png(report: dict[str, Any], path: Path) -> None:
    from training.results.plots import figure, save

    fig, ax = figure(7, 4.5)
    if report["points"]:
        x, y = zip(*report["points"])
        ax.scatter(x, y, s=6, alpha=0.5, color="#4C72B0")
    ax.axhline(0.0, color="grey", linewidth=1)
    ax.set(title="Residuals against predictions (validation)", xlabel="prediction", ylabel="label - prediction")
    save(fig, path, (ax,))


def _base64(path: Path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()


def evaluation_files(report: dict[str, Any], out: Path, *, step: int | None = None) -> list[Path]:
    """``report.json``, ``report.html`` and the picture (a classifier's ``confusion_matrix.png``, a
    regressor's ``residuals.png``) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    files = [out / "report.json"]
    where = f" of the final model (step {step})" if step is not None else ""
    if report["task"] == "classification":
        _confusion_png(report, out / "confusion_matrix.png")
        files.append(out / "confusion_matrix.png")
        rows = [[c["class"], f"{c['precision']:.4f}", f"{c['recall']:.4f}", f"{c['f1']:.4f}", c["support"]]
                for c in report["classes"]]
        body = (f"<p>{report['rows']} validation rows{where}: accuracy <b>{report['accuracy']:.4f}</b>, macro F1 "
                f"{report['macro_f1']:.4f}.</p><h2>Per class</h2>"
                + _table(["class", "precision", "recall", "F1", "support"], rows)
                + "<h2>Confusion matrix</h2><p>Rows: true class, columns: predicted.</p>"
                + _table(["true \\ predicted", *range(len(report["confusion_matrix"]))],
                         [[i, *row] for i, row in enumerate(report["confusion_matrix"])])
                # Inline: MLflow's viewer shows the page from a blob, where a relative file cannot load.
                + f'<p><img src="data:image/png;base64,{_base64(out / "confusion_matrix.png")}" alt="confusion matrix"></p>')
    elif report["task"] == "regression":
        _residuals_png(report, out / "residuals.png")
        files.append(out / "residuals.png")
        r2 = f"{report['r2']:.4f}" if report["r2"] is not None else "n/a"
        rows = [[k, f"{v:.4g}"] for k, v in report["residual_quantiles"].items()]
        body = (f"<p>{report['rows']} validation rows{where}: RMSE <b>{report['rmse']:.4g}</b>, MAE "
                f"{report['mae']:.4g}, R² {r2}.</p><h2>Residuals (label - prediction)</h2>"
                + _table(["quantile", "residual"], rows)
                + f'<p><img src="data:image/png;base64,{_base64(out / "residuals.png")}" alt="residuals"></p>')
    else:
        body = f"<pre>{html.escape(json.dumps(report, indent=2))}</pre>"
    (out / "report.html").write_text(_page(f"Evaluation ({report['task']})", body))
    return [*files, out / "report.html"]


# ---------------------------------------------------------------------------------- run plots


def run_plots(client, run_id: str, out: Path) -> list[Path]:
    """``loss_eval.png`` and ``throughput_step_time.png`` of one run, from its metric history."""
    import matplotlib

    matplotlib.use("Agg")
    from training.results.plots import figure, save

    def curve(key: str) -> tuple[list[int], list[float]]:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        return [s for s, _ in points], [v for _, v in points]

    out.mkdir(parents=True, exist_ok=True)
    written = []
    train, eval_loss, accuracy = curve("train/loss"), curve("eval/loss"), curve("eval/accuracy")
    if train[0]:
        fig, (ax1, ax2) = figure(11, 4, ncols=2)
        ax1.plot(*train, label="train/loss (mean over interval)")
        if eval_loss[0]:
            ax1.plot(*eval_loss, "o-", label="eval/loss (validation)")
        ax1.set(title="Loss", xlabel="optimizer step", ylabel="cross-entropy")
        if accuracy[0]:
            ax2.plot(*accuracy, "o-", color="#55A868", label="eval/accuracy")
            ax2.set_ylim(0, 1)
        else:
            ax2.text(0.5, 0.5, "no evaluation logged", ha="center", va="center", transform=ax2.transAxes)
        ax2.set(title="Evaluation accuracy (validation)", xlabel="optimizer step", ylabel="accuracy")
        written.append(out / "loss_eval.png")
        save(fig, written[-1], (ax1, ax2))
    step, throughput = curve("perf/step_s"), curve("perf/samples_per_s")
    if step[0]:
        exposed, in_flight = dict(zip(*curve("comm/exposed_fraction"))), dict(zip(*curve("comm/s_per_step")))
        fig, (ax1, ax2) = figure(11, 4, ncols=2)
        ax1.plot(*throughput, "o-", color="#4C72B0", markersize=3)
        ax1.set(title="Throughput (warm-up interval left out)", xlabel="optimizer step", ylabel="samples / s")
        ax1.set_ylim(bottom=0)
        total = [1000 * v for v in step[1]]
        # One bar per logged interval, as wide as the interval: a run of one interval still shows.
        gaps = [b - a for a, b in zip(step[0], step[0][1:])]
        width = 0.8 * (min(gaps) if gaps else max(1, step[0][0] // 2))
        comm = [1000 * (exposed[s] * v if exposed else min(v, in_flight.get(s, 0.0))) for s, v in zip(*step)]
        names = (("compute (and communication hidden behind it)", "exposed communication") if exposed else
                 ("rest of the step", "communication in flight (may overlap compute)") if in_flight else
                 ("step (no communication: one rank)", ""))
        ax2.bar(step[0], [t - c for t, c in zip(total, comm)], width=width, label=names[0], color="#4C72B0")
        if exposed or in_flight:
            ax2.bar(step[0], comm, width=width, bottom=[t - c for t, c in zip(total, comm)], label=names[1],
                    color="#DD8452")
        ax2.set(title="Step time split", xlabel="optimizer step", ylabel="ms per optimizer step")
        written.append(out / "throughput_step_time.png")
        save(fig, written[-1], (ax1, ax2))
    return written


def samples_markdown(samples: dict[str, Any]) -> str:
    """The model's text for a person: each prompt, then its greedy and its sampled continuation."""
    answers = samples.get("answers")  # SFT: held-out prompts, answered, beside the data's own answers
    what = "Held-out prompts answered" if answers else "Validation documents' beginnings continued"
    lines = [f"# Samples\n\n{what} by the model (tokenizer "
             f"{samples.get('tokenizer', '?')}; sampled: {samples.get('sampling', '')}).\n"]
    for i, prompt in enumerate(samples.get("prompts") or []):
        lines += [f"## Prompt {i + 1}\n", "```text", prompt, "```", "**Greedy:**\n", "```text",
                  samples["greedy"][i], "```", "**Sampled:**\n", "```text", samples["sampled"][i], "```\n"]
        if answers:
            lines += ["**The data's answer:**\n", "```text", answers[i], "```\n"]
    return "\n".join(lines) + "\n"
