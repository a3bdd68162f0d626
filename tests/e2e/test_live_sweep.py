"""The sweep DAG as a user runs it: triggered over REST on the session's live Airflow (scheduler,
LocalExecutor, torchrun over gloo, MLflow and the Optuna study on SQLite), a 4-point grid over
lr x hidden with ASHA and two lanes. The lanes train two trials at a time; the trials are child runs
of one parent run, tagged with their values; a trial with a hopeless learning rate is pruned at a
rung and keeps its checkpoint; the best trial's model is registered; the study is the record, so a
lane run again trains nothing. Then in the browser: the run's grid with its two mapped lanes, and
MLflow's compare view of the trials (screenshots; UPDATE_SCREENSHOTS=1 keeps them in docs/images/)."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from tests.e2e.browser import close_mlflow_assistant, keep_screenshot, login
from training.tracking.run import compare_url

pytestmark = pytest.mark.slow
SWEEP = "training_sweep"


def _most_at_once(trials) -> int:
    """The most trials that were running at one moment (from the study's start and end stamps)."""
    spans = [(t.datetime_start, t.datetime_complete) for t in trials]
    return max(sum(s <= start < e for s, e in spans) for start, _ in spans)


# The parallel-coordinates plot's "Metrics:" select (MLflow's design-system select, antd underneath).
METRICS = ("(() => { const l = [...document.querySelectorAll('div')].find(e => e.children.length === 0 && "
           "e.innerText.trim() === 'Metrics:'); return l && l.nextElementSibling; })()")
OPTION = "[...document.querySelectorAll('.du-bois-light-select-item-option')].find(o => (o.title || o.innerText) === {})"


def _plot_metric(b, metric: str) -> None:
    """Show ``metric`` alone on the compare view's parallel-coordinates plot, as a person picks it."""
    b.wait_for(f"{METRICS} != null", what="the plot's metric select")
    b.eval(f"{METRICS}.querySelectorAll('.du-bois-light-select-selection-item-remove').forEach(x => x.click())")
    b.eval(f"{METRICS}.querySelector('.du-bois-light-select-selector')"
           ".dispatchEvent(new MouseEvent('mousedown', {bubbles: true}))")
    # The list is virtual (a run logs some 100 metrics): typed, it shows only the ones that match.
    b.eval(f"{METRICS}.querySelector('input').focus()")
    b.send("Input.insertText", text=metric)
    b.wait_for(f"{OPTION.format(json.dumps(metric))} !== undefined", what=f"{metric} among the plot's metrics")
    b.eval(f"{OPTION.format(json.dumps(metric))}.click()")
    b.wait_for(f"{METRICS}.innerText.trim() === {json.dumps(metric)}", what=f"{metric} alone on the plot")
    b.eval("document.activeElement.blur(); document.body.dispatchEvent(new MouseEvent('mousedown', {bubbles: true}))")


@pytest.mark.budget(300, reason="a sweep of four trials on the live stack (eight task processes, four torchruns) "
                                "and two pages in the browser")
def test_a_sweep_trains_two_trials_at_a_time_prunes_the_hopeless_one_and_registers_the_best(
        live_airflow, mlflow_ui, dataset, tmp_root, browser, tmp_path):
    import optuna

    from training_airflow import settings

    af = live_airflow
    af.wait_for_dags(SWEEP)
    af.unpause(SWEEP)
    experiment = "live-sweep"
    conf = {"dataset_uri": str(dataset), "experiment": experiment, "store_uri": (tmp_root / f"{experiment}-store").as_uri(),
            "steps": 40, "eval_every": 10, "batch_size": 32, "log_every": 10, "world_size": 1,
            "search_space": {"lr": [1e-2, 1e-7], "hidden": [16, 32]}, "sampler": "grid", "pruner": "asha",
            "trials": 4, "max_parallel_trials": 2, "objective": "eval/loss", "registered_model": experiment}
    run_id = af.trigger(SWEEP, conf)
    assert af.wait_for_run(SWEEP, run_id, timeout=900)["state"] == "success", af.task_states(SWEEP, run_id)
    lanes = {ti["map_index"]: ti["rendered_map_index"] for ti in af.task_instances(SWEEP, run_id)
             if ti["task_id"] == "trials"}
    assert sorted(lanes) == [0, 1]

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("airflow.dag_run_id") == run_id)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and len(children) == 4
    assert all(r.info.status == "FINISHED" for r in children)
    grid = sorted((float(r.data.params["lr"]), int(r.data.params["hidden"])) for r in children)
    assert grid == [(1e-7, 16), (1e-7, 32), (1e-2, 16), (1e-2, 32)]  # every point of the grid, once
    for r in children:
        assert r.data.tags["sweep.param.lr"] == r.data.params["lr"]

    study = optuna.load_study(study_name=parent.info.run_id, storage=settings.sweep_storage_url())
    assert _most_at_once(study.trials) == 2, [(t.number, t.datetime_start, t.datetime_complete) for t in study.trials]
    by_state = {}
    for t in study.trials:
        by_state.setdefault(t.state.name, []).append(t)
    # lr=1e-7 barely moves: at a rung it is behind a trial that learns, and is pruned there. The
    # grid's seeded order is 1e-2, 1e-7, 1e-2, 1e-7: the first pair trains side by side (which of them
    # reaches a rung first is the machine's; the first to reach a rung is never pruned), and the last
    # 1e-7 trial, which starts once one of them has ended, always finds a learning trial at its rung.
    pruned = by_state.get("PRUNED", [])
    assert pruned and all(t.params["lr"] == 1e-7 and t.user_attrs["steps"] < 40 for t in pruned), \
        [(t.number, t.state.name, t.params, t.user_attrs.get("steps")) for t in study.trials]
    assert all(t.user_attrs["steps"] == 40 for t in by_state["COMPLETE"])
    best = study.best_trial
    assert best.params["lr"] == 1e-2
    # The grid names each lane by how its trials ended: a pruned one where it stopped.
    for t in study.trials:
        ended = f"trial {t.number} complete" if t.state.name == "COMPLETE" else \
            f"trial {t.number} pruned at step {t.user_attrs['steps']}"
        lane = t.user_attrs["lane"]
        assert ended in lanes[lane] and lanes[lane].startswith(f"lane {lane}: "), (ended, lanes)

    summary = client.get_run(parent.info.run_id).data
    spent = sum(t.user_attrs["steps"] for t in study.trials)
    assert summary.metrics["sweep/steps_spent"] == spent < summary.metrics["sweep/steps_without_pruning"] == 160
    assert summary.metrics["sweep/trials_pruned"] == len(pruned)
    assert summary.tags["sweep.best_run_id"] == best.user_attrs["mlflow_run_id"]
    table = open(client.download_artifacts(parent.info.run_id, "sweep/trials.md")).read()
    assert all(r.info.run_id in table for r in children) and "pruned" in table
    assert {"sweep/optimization_history.png", "sweep/parallel_coordinates.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    # The pruned trial's checkpoint is kept: its model was committed at the rung and evaluated.
    for t in pruned:
        assert t.user_attrs["scored"]["eval_step"] == t.user_attrs["steps"]
    version = client.get_model_version_by_alias(experiment, "champion")
    assert version.run_id == best.user_attrs["mlflow_run_id"]

    # The study is the record: a lane run again finds every trial finished and trains none.
    from training_airflow import sweep_tasks

    lane = {"mlflow_run_id": parent.info.run_id, "study": parent.info.run_id, "dataset_uri": str(dataset),
            "dataset_fingerprint": "", "lane": 0}
    params = {name: p.value for name, p in sweep_tasks.sweep_params().items()} | conf
    assert sweep_tasks.run_lane(params, lane) == {"lane": 0, "trials": []}
    assert len(optuna.load_study(study_name=parent.info.run_id, storage=settings.sweep_storage_url()).trials) == 4

    # In the browser: the run's grid, its trials task mapped over the two lanes...
    b = browser
    login(b, af, f"/dags/{SWEEP}/runs/{run_id}/tasks/trials/mapped")
    shown = b.wait_for("(() => { const t = document.body.innerText; "
                       "return t.includes('lane 0') && t.includes('lane 1') && t; })()",
                       what="the two lanes of the trials task", timeout=60)
    assert "trials" in shown and "report" in shown, shown[:2000]
    keep_screenshot(b.screenshot(tmp_path / "airflow_sweep_lanes.png"))
    # ...and MLflow's compare view of the four trials, lined up by their sampled values.
    ids = [r.info.run_id for r in sorted(children, key=lambda r: int(r.data.tags["sweep.trial"]))]
    b.goto(compare_url(mlflow_ui, exp.experiment_id, ids))
    b.wait_for(f"document.body.innerText.includes({json.dumps(children[0].info.run_name)}) && "
               "document.body.innerText.includes('Parallel Coordinates')", what="the compare view of the trials")
    close_mlflow_assistant(b)
    _plot_metric(b, "eval/loss")  # the sweep's objective, in place of the metric MLflow picks first
    b.wait_for("document.querySelectorAll('.js-plotly-plot').length > 0", what="the parallel-coordinates plot")
    keep_screenshot(b.screenshot(tmp_path / "mlflow_sweep_compare.png"))
