"""Task bodies and Params of the ``training_sweep`` DAG: a hyperparameter search over the training
pipeline's own tasks, recorded in one Optuna study and one MLflow parent run with a child run per
trial.

``open_sweep`` checks the base run and the search before anything is spent and opens both;
``validate_data`` and ``tokenize`` run once for the sweep (the pipeline's tasks); each mapped
``trials`` task is a lane that trains trials one after another (train -> commit -> evaluate, the
local backend's and the pipeline's functions), ``max_parallel_trials`` lanes side by side; ``report``
registers the best trial's model and logs the sweep's history. Heavy imports stay inside the functions.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from airflow.sdk import Param

from training_airflow import settings
from training_airflow.failures import fails_fast
from training_airflow.params import training_params
from training_airflow.sweep_check import base_config, check_search, search_of

log = logging.getLogger(__name__)

SECTION = "Sweep"
DEFAULT_SPACE = {"lr": {"low": 1e-3, "high": 3e-2, "log": True}, "hidden": [32, 64, 128]}
# The base run's defaults a sweep changes: its own experiment, rungs for the pruner.
BASE_DEFAULTS = {"experiment": "training_sweep", "eval_every": 25, "steps": 200}


def sweep_params() -> dict[str, Param]:
    """The base run's Params (the local backend's: trials train on the worker) and the search's."""
    from training.sweep.space import OBJECTIVES, PRUNERS, SAMPLERS

    out = {}
    for name, p in training_params(backends=["local"]).items():
        out[name] = Param(BASE_DEFAULTS.get(name, p.value), description=p.description, **p.schema)
    out.update({
        "search_space": Param(DEFAULT_SPACE, type="object", section=SECTION, title="Search space",
                              description='Trainer fields to search: a list of choices ([32, 64]) or a range '
                                          '({"low": 1e-4, "high": 1e-2, "log": true}; "step" for a grid). Every value '
                                          "is checked against the base run above before any trial."),
        "sampler": Param("tpe", type="string", enum=list(SAMPLERS), section=SECTION, title="Sampler",
                         description="How the next trial's values are chosen: tpe (Optuna's TPE, learns from "
                                     "the trials so far), random, or grid (every combination of the choices)."),
        "pruner": Param("asha", type="string", enum=list(PRUNERS), section=SECTION, title="Early stopping",
                        description="asha: asynchronous successive halving at the evaluations (eval_every): a "
                                    "trial goes on past a rung only in the best half of those that reached it; "
                                    "none: every trial trains all its steps."),
        "trials": Param(6, type="integer", minimum=1, maximum=1000, section=SECTION, title="Trials",
                        description="Trials of the sweep in all."),
        "max_parallel_trials": Param(2, type="integer", minimum=1, maximum=64, section=SECTION,
                                     title="Parallel trials", description="Trials training at once (lanes)."),
        "objective": Param("auto", type="string", enum=list(OBJECTIVES), section=SECTION, title="Objective",
                           description="The evaluation metric the sweep optimizes (lower is better for loss, "
                                       "rmse and bits per byte); auto: accuracy, R² or bits per byte by the task."),
    })
    return out


@fails_fast
def open_sweep(params: dict[str, Any], *, dag_id: str, dag_run_id: str, dag_run: Any = None) -> dict[str, Any]:
    """Check the base run and the search, open the sweep's MLflow run (the parent) and its study."""
    from training_airflow import tasks

    check_search({**params, "dataset_uri": settings.resolve_path(params["dataset_uri"])})
    named = {**params, "run_name": params.get("run_name") or f"sweep-{params['sampler']}-{params['trials']}trials"}
    opened = tasks.open_run(named, dag_id=dag_id, dag_run_id=dag_run_id, dag_run=dag_run, param_spec=sweep_params(),
                            tags={"sweep": "parent", "sweep.sampler": params["sampler"], "sweep.pruner": params["pruner"],
                                  "sweep.trials": str(params["trials"])})
    from training_airflow.mlflow_run import run_logger

    run_logger(opened["mlflow_run_id"]).log_text(json.dumps(params["search_space"], indent=2), "sweep/search_space.json")
    log.info("sweep: %s trials, %d at once, %s sampler, %s pruner over %s", params["trials"],
             params["max_parallel_trials"], params["sampler"], params["pruner"], json.dumps(params["search_space"]))
    return {**opened, "study": opened["mlflow_run_id"]}


def lanes(params: dict[str, Any], validated: dict[str, Any]) -> list[dict[str, Any]]:
    """One lane per parallel trial: what each mapped ``trials`` task gets."""
    return [{**validated, "lane": i} for i in range(int(params["max_parallel_trials"]))]


def _objective(params: dict[str, Any], validated: dict[str, Any]) -> tuple[str, str]:
    """The metric the sweep optimizes and its direction, by the task the data gate recorded."""
    from mlflow.tracking import MlflowClient

    from training.sweep.space import direction_of, objective_for

    task = MlflowClient().get_run(validated["mlflow_run_id"]).data.tags.get("data.task", "classification")
    metric = objective_for(params["objective"], task)
    return metric, direction_of(metric)


@fails_fast
def run_lane(params: dict[str, Any], lane: dict[str, Any]) -> dict[str, Any]:
    """Train trials one after another until the study has ``trials`` of them: this lane's trial
    that a kill interrupted first (from its last checkpoint), then new ones. A failing trial is
    recorded as failed in the study and its child run, and the lane goes on."""
    settings.ensure_tracking_uri()
    from training.sweep.study import next_trial

    search = search_of(params)
    dists = search.check(base_config({**params, "dataset_uri": lane["dataset_uri"]}))
    objective, direction = _objective(params, lane)
    url, done = settings.sweep_storage_url(), []
    while True:
        study, trial, resumed = next_trial(lane["study"], search, dists, direction=direction, url=url, lane=lane["lane"])
        if trial is None:
            break
        done.append(_run_trial(params, lane, study, trial, objective=objective, url=url, resumed=resumed))
    log.info("lane %d: trials %s", lane["lane"], ", ".join(f"{d['trial']} {d['state']}" for d in done) or "none")
    return {"lane": lane["lane"], "trials": done}


def lane_label(ran: dict[str, Any]) -> str:
    """The name the grid shows for a lane that has ended: its trials and how each ended, so that a
    pruned trial is seen where it stopped without opening a log (Airflow keeps 250 characters)."""
    parts = [f"trial {t['trial']} {t['state']}" + (f" at step {t['steps']}" if t["state"] != "complete" else "")
             for t in ran["trials"]]
    label = f"lane {ran['lane']}: " + (", ".join(parts) or "no trial left to train")
    return label if len(label) <= 200 else label[:199] + "\u2026"


def _child_run(params: dict[str, Any], parent: str, trial: Any, study_name: str) -> str:
    from mlflow.tracking import MlflowClient

    from training.results.bench import TAG_PARENT

    known = trial.user_attrs.get("mlflow_run_id")
    if known:
        return known
    client = MlflowClient()
    exp = client.get_run(parent).info.experiment_id
    values = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
    child = client.create_run(exp, run_name=f"trial-{trial.number} {values}", tags={
        TAG_PARENT: parent, "sweep": "trial", "sweep.study": study_name, "sweep.trial": str(trial.number),
        **{f"sweep.param.{k}": str(v) for k, v in trial.params.items()}}).info.run_id
    trial.set_user_attr("mlflow_run_id", child)
    return child


def _steps_logged(run_id: str) -> int:
    """The last step a (failed) trial's ranks logged its training loss at, 0 when none or MLflow fails."""
    from mlflow.tracking import MlflowClient

    try:
        return max((m.step for m in MlflowClient().get_metric_history(run_id, "train/loss")), default=0)
    except Exception as e:  # the record of a failure must never hide it
        log.warning("steps of the failed trial's run %s not read: %s", run_id, e)
        return 0


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _run_trial(params: dict[str, Any], lane: dict[str, Any], study: Any, trial: Any, *, objective: str, url: str,
               resumed: bool) -> dict[str, Any]:
    from optuna.trial import TrialState

    from training.sweep.pruning import OBJECTIVE_ENV, STORAGE_ENV, STUDY_ENV, TRIAL_ENV
    from training.sweep.study import STATE_TAG, trial_id
    from training_airflow import tasks
    from training_airflow.backends import local
    from training_airflow.mlflow_run import run_logger

    child = _child_run(params, lane["mlflow_run_id"], trial, lane["study"])
    values = trial.params
    log.info("trial %d%s: %s (MLflow run %s)", trial.number, " resumed" if resumed else "", json.dumps(values), child)
    trial_params = {**params, **values, "run_name": ""}
    env = {STORAGE_ENV: url, STUDY_ENV: lane["study"], TRIAL_ENV: str(trial_id(trial)), OBJECTIVE_ENV: objective}
    logger = run_logger(child)
    handoff = {k: lane[k] for k in ("dataset_uri", "dataset_fingerprint", "token_shards") if k in lane}
    try:
        trained = local.run_torchrun(trial_params, {**handoff, "mlflow_run_id": child}, extra_env=env)
        scored = tasks.evaluate(trial_params, local.commit(trial_params, trained))
    except Exception as e:  # one trial's failure is the trial's: recorded, and the sweep goes on
        reason = f"{type(e).__name__}: {e}"[:500]
        log.error("trial %d failed: %s", trial.number, reason)
        steps = _steps_logged(child)  # what the failed trial spent counts in the sweep's steps too
        trial.set_user_attr("steps", steps)
        study.tell(trial, state=TrialState.FAIL)
        logger.set_tags({STATE_TAG: "failed", "failure.reason": reason})
        logger.finish("FAILED")
        return {"trial": trial.number, "state": "failed", "mlflow_run_id": child, "reason": reason, "steps": steps}
    steps = int(trained["final_step"])
    trial.set_user_attr("steps", steps)
    trial.set_user_attr("scored", json.loads(json.dumps(scored, default=str)))
    value = scored["eval_metrics"].get(objective)
    if trained.get("pruned_at") is not None:
        trial.set_user_attr("pruned_at", trained["pruned_at"])
        study.tell(trial, state=TrialState.PRUNED)
        logger.set_tags({STATE_TAG: "pruned", "sweep.pruned_at": str(trained["pruned_at"])})
        state = "pruned"
    elif value is None or not math.isfinite(value):
        study.tell(trial, state=TrialState.FAIL)
        logger.set_tags({STATE_TAG: "failed", "failure.reason": f"{objective} is {value}"})
        state = "failed"
    else:
        study.tell(trial, value)
        logger.set_tags({STATE_TAG: "complete"})
        state = "complete"
    logger.log_summary({"sweep/steps": steps})
    logger.finish("FINISHED")
    log.info("trial %d %s after %d steps: %s %s", trial.number, state, steps, objective, value)
    return {"trial": trial.number, "state": state, "value": value, "steps": steps, "mlflow_run_id": child}


@fails_fast
def report(params: dict[str, Any], validated: dict[str, Any]) -> dict[str, Any]:
    """The sweep's result in its parent run: the table of trials, the optimization history and
    parallel-coordinates plots, steps spent against every trial trained to the end; the best
    trial's model through the registry gate."""
    settings.ensure_tracking_uri()
    import optuna
    from optuna.trial import TrialState

    from training.sweep.study import history_json, plots, rows, storage, table_markdown
    from training_airflow import tasks
    from training_airflow.mlflow_run import run_logger

    parent = validated["mlflow_run_id"]
    objective, _ = _objective(params, validated)
    study = optuna.load_study(study_name=validated["study"], storage=storage(settings.sweep_storage_url()))
    trials = study.get_trials(deepcopy=False)
    table = rows(study)
    logger = run_logger(parent)
    logger.log_text(table_markdown(table, objective), "sweep/trials.md")
    logger.log_text(history_json(study), "sweep/trials.json")
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        if plots(study, Path(tmp), objective):
            logger.client.log_artifacts(parent, tmp, "sweep")
    counts = {s: sum(t.state == getattr(TrialState, s.upper()) for t in trials) for s in ("complete", "pruned", "fail")}
    spent = sum(int(t.user_attrs.get("steps") or 0) for t in trials)
    full = len(trials) * int(params["steps"])
    figures = {"sweep/trials_complete": counts["complete"], "sweep/trials_pruned": counts["pruned"],
               "sweep/trials_failed": counts["fail"], "sweep/steps_spent": spent, "sweep/steps_without_pruning": full,
               "sweep/steps_saved_fraction": 1 - spent / full if full else 0.0}
    if not counts["complete"]:
        _log_figures(logger, figures)
        raise RuntimeError(f"no trial of the sweep completed ({counts['pruned']} pruned, {counts['fail']} failed): "
                           "see the trials' MLflow runs")
    best = study.best_trial
    figures[f"sweep/best_{objective.removeprefix('eval/')}"] = best.value
    _log_figures(logger, figures)
    logger.set_tags({"sweep.best_trial": str(best.number), "sweep.best_run_id": best.user_attrs["mlflow_run_id"],
                     **{f"sweep.best.{k}": str(v) for k, v in best.params.items()}})
    log.info("sweep: best trial %d (%s %.4f) with %s; %d complete, %d pruned, %d failed; %d steps of %d", best.number,
             objective, best.value, json.dumps(best.params), counts["complete"], counts["pruned"], counts["fail"],
             spent, full)
    registered = tasks.register({**params, **best.params}, best.user_attrs["scored"])
    logger.finish("FINISHED")
    return {"mlflow_run_id": parent, "best_trial": best.number, "best_value": best.value, "best_params": best.params,
            "registry": registered["registry"], **figures}


def _log_figures(logger: Any, figures: dict[str, float]) -> None:
    """The sweep's figures in summary.json and as metrics (MLflow's compare view lines sweeps up)."""
    logger.log_summary(figures)
    logger.log_metrics_once(figures, step=0)
