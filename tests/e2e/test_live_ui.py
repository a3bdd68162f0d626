"""The web UIs in a real (headless) browser, as a person uses them after a few runs:

- Airflow: log in with the form, open the trigger form of distributed_training (every field, the
  defaults accepted, an invalid value refused with the reason);
- Airflow -> MLflow: a task's "MLflow run" link opens that run's page in MLflow, whose description
  links back to the Airflow run; a failed run's link opens a FAILED run that says why;
- MLflow: the experiment opens on its runs table with loss, evaluation and throughput columns; a
  run's artifacts hold its plots, config, train log, evaluation report and data-gate page; the
  compare view of two runs, "diff only", lists only the params that differ.

The runs are the session's (``live_runs``, shared with test_live_airflow.py); MLflow's own server
(``mlflow_ui``) serves the session's tracking store. Screenshots go to the test's tmp folder; with
UPDATE_SCREENSHOTS=1 (`make screenshots`) they also replace the ones in docs/images/ that the README
shows.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from urllib.parse import quote

from mlflow.tracking import MlflowClient

from tests.e2e.browser import Browser, close_mlflow_assistant, keep_screenshot, login
from tests.e2e.conftest import EXPERIMENT, ON_DATA, RUN_NOTE, TRAIN
from training.tracking.run import compare_url, experiment_url, run_url

pytestmark = pytest.mark.slow
DIALOG = "[...document.querySelectorAll('[role=dialog]')].find(d => d.innerText.includes('Run Parameters'))"
TRIGGER_ENABLED = (f"(() => {{ const d = {DIALOG}; const b = d && [...d.querySelectorAll('button')]"
                   ".find(b => b.innerText.trim() === 'Trigger'); return b ? !b.disabled : null; })()")


def test_trigger_form_in_the_browser(live_airflow, browser, tmp_path):
    af, b = live_airflow, browser
    af.wait_for_dags("distributed_training")
    details = af.dag_details("distributed_training")

    login(b, af, "/dags/distributed_training")

    b.click_button("Trigger")
    b.wait_for(f"!!{DIALOG}", what="the trigger form")
    text = b.wait_for(f"{DIALOG}.innerText", what="form text")
    shown = 0
    for name, p in details["params"].items():
        schema = p["schema"]
        if schema.get("section"):  # collapsed under its section heading
            assert schema["section"] in text
            continue
        assert schema["title"] in text and p["description"] in text, name
        shown += 1
    assert shown >= 10
    assert b.wait_for(TRIGGER_ENABLED, timeout=30, what="Trigger enabled") is True, "the defaults must be accepted"
    keep_screenshot(b.screenshot(tmp_path / "trigger_form.png"))

    # Numbers are kept inside their limits by the form itself: 0 ranks becomes the minimum, 1.
    field = "input[name=element_world_size]"
    b.eval(f"document.querySelector('{field}').select()")
    b.type_into(field, "0")
    b.eval(f"document.querySelector('{field}').blur()")
    assert b.wait_for(f"document.querySelector('{field}').value === '1'", timeout=30, what="world_size clamped to 1")

    # A value the form cannot judge (a pattern): the server refuses it and no run is created.
    runs_before = len(af.runs("distributed_training"))
    field = "input[name=element_experiment]"
    b.eval(f"document.querySelector('{field}').select()")
    b.type_into(field, "../etc")
    b.click_button("Trigger", within=DIALOG)
    b.wait_for("document.body.innerText.includes('Failed to Trigger Dag')", timeout=60, what="the refusal")
    reason = b.wait_for(f"{DIALOG}.innerText.includes(\"Failed validating 'pattern'\") && {DIALOG}.innerText",
                        what="the server's reason in the form")
    assert "'../etc'" in reason
    assert len(af.runs("distributed_training")) == runs_before
    b.eval(f"document.querySelector('{field}').scrollIntoView({{block: 'center'}})")
    keep_screenshot(b.screenshot(tmp_path / "trigger_form_refused.png"))
    assert (tmp_path / "trigger_form.png").stat().st_size > 20_000


# ------------------------------------------------------------------------------ Airflow <-> MLflow

CORE = ("open_run", "validate_data", "tokenize", "train", "upload_checkpoint", "evaluate", "register", "report")
TASK_LINK = "[...document.querySelectorAll('a')].find(a => a.innerText.trim() === 'MLflow run')"


def _mlflow_run(dag_id: str, dag_run_id: str):
    client = MlflowClient()
    exp = client.get_experiment_by_name(EXPERIMENT)
    (run,) = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`airflow.dag_id` = '{dag_id}' and tags.`airflow.dag_run_id` = '{dag_run_id}'"))
    return run


def _show_description(b: Browser) -> None:
    """The run page shows the first lines of the description: expand it and bring it to the top."""
    b.click_button("Show more")
    b.eval("[...document.querySelectorAll('*')].find(e => e.children.length === 0 && e.innerText === 'Description')"
           "?.scrollIntoView({block: 'start'})")


def _task_link(b: Browser, af, dag_id: str, run_id: str, task: str) -> str:
    b.goto(f"{af.base}/dags/{dag_id}/runs/{quote(run_id, safe='')}/tasks/{task}/details")  # Extra Links
    return b.wait_for(f"(() => {{ const a = {TASK_LINK}; return a && a.href; }})()", what=f"the MLflow link of {task}")


@pytest.fixture(scope="module")
def finished(live_airflow, live_runs, mlflow_ui):
    """The REST-triggered run and the data-driven one, both finished, with their MLflow runs."""
    af = live_airflow
    assert af.wait_for_run(TRAIN, live_runs["rest"], timeout=900)["state"] == "success"
    deadline = time.monotonic() + 600
    while not (asset := af.runs(ON_DATA, run_type="asset_triggered")) and time.monotonic() < deadline:
        time.sleep(2)
    assert asset, "register_dataset's event started no data-driven run"
    assert af.wait_for_run(ON_DATA, asset[0]["dag_run_id"], timeout=1200)["state"] == "success"
    return {"rest": _mlflow_run(TRAIN, live_runs["rest"]), "asset": _mlflow_run(ON_DATA, asset[0]["dag_run_id"])}


def test_every_task_links_to_its_mlflow_run_and_the_run_back(live_airflow, live_runs, mlflow_ui, finished, browser,
                                                              tmp_path):
    af, b = live_airflow, browser
    rest = finished["rest"]
    page = run_url(mlflow_ui, rest.info.experiment_id, rest.info.run_id)
    for task in CORE:  # every task of the run, as the API server answers the UI
        links = af.extra_links(TRAIN, live_runs["rest"], task)
        assert links == {"MLflow run": page}, (task, links)
    assert rest.info.run_name == "mlp-ddp-fp32-1rank-20steps"  # what it trains; the Airflow run id is a tag
    assert rest.data.tags["airflow.note"] == RUN_NOTE and f"**Airflow note:** {RUN_NOTE}" in rest.data.tags[
        "mlflow.note.content"], "the Airflow run's note is in the MLflow run's description"

    # In the browser, the data-driven run (2 ranks, 300 steps: curves worth a look).
    run, dag_run_id = finished["asset"], finished["asset"].data.tags["airflow.dag_run_id"]
    page = run_url(mlflow_ui, run.info.experiment_id, run.info.run_id)
    login(b, af, f"/dags/{ON_DATA}/runs/{dag_run_id}")
    assert _task_link(b, af, ON_DATA, dag_run_id, "train") == page
    keep_screenshot(b.screenshot(tmp_path / "airflow_task_mlflow_link.png"))

    b.goto(page)  # what the link opens
    b.wait_for(f"document.body.innerText.includes({json.dumps(run.info.run_name)})", what="the MLflow run page")
    close_mlflow_assistant(b)
    assert run.info.run_name == "mlp-ddp-fp32-2ranks-300steps"
    back = run.data.tags["airflow.url"]
    assert back == f"{af.base}/dags/{ON_DATA}/runs/{quote(dag_run_id, safe='')}"
    href = b.wait_for(f"(() => {{ const a = [...document.querySelectorAll('a')].find(a => a.href === {json.dumps(back)}); "
                      "if (!a) return null; a.scrollIntoView({block: 'start'}); return a.href; })()",
                      what="the link back to the Airflow run in the description")
    b.wait_for("[...document.querySelectorAll('img')].filter(i => i.src.includes('plots/') && i.naturalWidth > 0)"
               ".length === 2", what="the loss and throughput plots in the description")
    _show_description(b)
    keep_screenshot(b.screenshot(tmp_path / "mlflow_run_page.png"))
    b.goto(href)  # and back: the Airflow run page
    b.wait_for(f"document.body.innerText.includes({json.dumps(dag_run_id)})", what="the Airflow run page")


def test_a_failed_run_links_to_a_failed_mlflow_run_that_says_why(live_airflow, live_runs, mlflow_ui, browser, tmp_path):
    af, b, dag_run_id = live_airflow, browser, live_runs["bad_data"]
    assert af.wait_for_run(ON_DATA, dag_run_id, timeout=900)["state"] == "failed"
    run = _mlflow_run(ON_DATA, dag_run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure.task"] == "validate_data"
    assert "expect_column_values_to_not_be_null(f5): 50 bad values" in run.data.tags["failure.reason"]

    login(b, af, f"/dags/{ON_DATA}/runs/{dag_run_id}")
    # The tasks that never ran link to the same run: the link is per DAG run, not per task.
    page = run_url(mlflow_ui, run.info.experiment_id, run.info.run_id)
    assert _task_link(b, af, ON_DATA, dag_run_id, "evaluate") == page
    b.goto(page)
    b.wait_for("document.body.innerText.includes('Failed:') && document.body.innerText.includes('50 bad values')",
               what="the failure and its reason on the run page")
    close_mlflow_assistant(b)
    assert "FAILED" in b.text()
    _show_description(b)
    keep_screenshot(b.screenshot(tmp_path / "mlflow_failed_run.png"))


# ------------------------------------------------------------------------------ MLflow


def test_experiment_opens_on_runs_with_loss_eval_and_throughput(mlflow_ui, finished, browser, tmp_path):
    b, run = browser, finished["rest"]
    b.goto(experiment_url(mlflow_ui, run.info.experiment_id))
    headers = "[...document.querySelectorAll('[role=columnheader]')].map(e => e.innerText.trim())"
    b.wait_for(f"{headers}.includes('eval/accuracy') && {headers}.includes({json.dumps(finished['asset'].info.run_name)})"
               f" || document.body.innerText.includes({json.dumps(finished['asset'].info.run_name)}) && "
               f"{headers}.includes('eval/accuracy')", what="the runs table with its metric columns")
    close_mlflow_assistant(b)
    b.eval("document.querySelector('.ag-center-cols-viewport, .ag-body-horizontal-scroll-viewport')?.scrollBy(230, 0)")
    shown = set(b.eval(headers))
    assert {"eval/accuracy", "eval/loss"} <= shown, shown
    text = b.text()
    assert run.info.run_name in text and finished["asset"].info.run_name in text
    assert "Dataset" in shown and "teacher (" in text, "the Dataset column names what each run trained on"
    assert "Traces" not in [t for t in b.eval("[...document.querySelectorAll('h1,h2')].map(e => e.innerText.trim())")]
    keep_screenshot(b.screenshot(tmp_path / "mlflow_runs.png"))


def test_run_artifacts_hold_plots_config_log_and_reports(mlflow_ui, finished, browser, tmp_path):
    b, run = browser, finished["asset"]
    b.goto(run_url(mlflow_ui, run.info.experiment_id, run.info.run_id).replace("?", "/artifacts/evaluation/report.html?"))
    tree = "document.body.innerText"
    for name in ("plots", "evaluation", "logs", "data_gate.html", "train_config.json", "summary.json", "data_docs"):
        b.wait_for(f"{tree}.includes({json.dumps(name)})", what=f"artifact {name}")
    close_mlflow_assistant(b)
    # The evaluation report renders in MLflow's viewer (a sandboxed frame the page cannot read into;
    # the same file through the UI server's artifact endpoint says what it shows).
    b.wait_for("[...document.querySelectorAll('iframe')].some(f => f.src.startsWith('blob:'))", what="the report frame")
    report = requests.get(f"{mlflow_ui}/get-artifact", params={"path": "evaluation/report.html", "run_uuid": run.info.run_id},
                          timeout=30).text
    assert "Per class" in report and "precision" in report and "Confusion matrix" in report
    time.sleep(2)  # the frame paints
    keep_screenshot(b.screenshot(tmp_path / "mlflow_run_artifacts.png"))


def test_compare_view_diff_only_lists_the_params_that_differ(mlflow_ui, finished, browser, tmp_path):
    b, runs = browser, [finished["rest"], finished["asset"]]
    ids = [r.info.run_id for r in runs]
    differ = {k for k in set(runs[0].data.params) | set(runs[1].data.params)
              if runs[0].data.params.get(k) != runs[1].data.params.get(k)}
    assert not differ & {"checkpoint_dir", "output_dir", "config_hash", "perf/peak_flops"}, differ
    assert {"world_size", "steps", "dataset_uri"} <= differ, differ
    b.goto(compare_url(mlflow_ui, runs[0].info.experiment_id, ids))
    b.wait_for(f"document.body.innerText.includes({json.dumps(runs[1].info.run_name)}) && "
               "document.body.innerText.includes('Parameters')", what="the compare view")
    close_mlflow_assistant(b)
    b.eval("document.querySelector('button[aria-label=\\'Parameters - Show diff only\\']').click()")
    table = "[...document.querySelectorAll('table')].find(t => [...t.rows].some(r => r.cells[0] && " \
            "r.cells[0].innerText.trim() === 'world_size'))"
    rows = f"(() => {{ const t = {table}; return t ? [...t.rows].map(r => r.cells[0].innerText.trim()) : null; }})()"
    shown = set(b.wait_for(f"(() => {{ const r = {rows}; return r && r.length === {len(differ)} && r; }})()",
                           what=f"{len(differ)} differing params", timeout=60))
    assert shown == differ, (shown, differ)
    b.eval(f"{table}.scrollIntoView({{block: 'center'}})")
    keep_screenshot(b.screenshot(tmp_path / "mlflow_compare.png"))
