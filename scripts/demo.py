"""`make demo`: one full run of the `distributed_training` DAG on the embedded defaults.

Makes the demo dataset if it is missing, runs the DAG in this process with `dag.test()` (a real
Airflow DagRun in the project-local SQLite metadata DB, tasks run one after another), then reads
the run back from MLflow and prints where to look. Run it again for a second run.

The one-time set-up runs side by side: the dataset and Airflow's database migration in child
processes while this process loads the DAG, creates the MLflow store's tables and starts the Task
Execution API that ``dag.test()`` runs in-process (a deployment's api-server is up before any run). The tasks' logs
are also written where a worker writes them (training_airflow.inprocess_logs), so after
`make airflow-up` the run's page shows every task's log, like a run made by the scheduler.
`dag.test()` rather than the scheduler: one process, no servers left running, and no start-up
of four Airflow parts before the first task.

    python scripts/demo.py [--set key=value ...]     # e.g. --set world_size=1 --set steps=500
    python scripts/demo.py --set dataset_uri=/data/wine --set label_column=target   # your own table

On the embedded demo data (a classification table) the demo asks for time-to-accuracy
(``DEMO_CONF``: the time from the start of training until eval/accuracy first reaches 0.80 on the
validation split; docs/benchmarks.md "Time to accuracy" says why not more on this data);
--set target_metric=none turns it off. On other data (any --set of dataset_uri, text_column or
task) it asks for no target, since accuracy is only measured for classification: name one that
fits, e.g. --set target_metric=eval/bits_per_byte --set target_value=2.5 for a language model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import project_env

project_env.apply()  # before anything imports Airflow or MLflow: both read their settings on import

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONF = {"target_metric": "eval/accuracy", "target_value": 0.8}
# A --set of any of these changes the data or its task: the accuracy target may not fit it.
DATA_FIELDS = ("dataset_uri", "text_column", "task")


def _load_dag(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


def _execution_api():
    """A client of the Task Execution API that ``dag.test()`` runs in this process, its app built now:
    the part of Airflow a deployment's api-server has up before any run, here made during the
    one-time set-up instead of inside the run's first task."""
    import httpx
    from airflow.sdk.execution_time.supervisor import in_process_api_server

    api = in_process_api_server()  # cached: the one dag.test() uses
    return httpx.Client(transport=api.transport, base_url="http://in-process.invalid")


def _task_times(dag_run) -> str:
    """Each task's wall time, in the order they ran."""
    try:
        tis = [ti for ti in dag_run.get_task_instances() if ti.start_date and ti.end_date]
    except Exception as e:  # a summary line: never fail the demo over it
        return f"(not read: {e})"
    tis.sort(key=lambda ti: ti.start_date)
    return ", ".join(f"{ti.task_id} {(ti.end_date - ti.start_date).total_seconds():.1f}s" for ti in tis)


def run_conf(sets: list[str]) -> dict:
    """The run's conf from ``--set key=value`` items (a value is JSON where it parses, else a
    string), with ``DEMO_CONF`` beneath them on the embedded data only."""
    conf = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} has no '=': write --set key=value")
        try:
            conf[key] = json.loads(raw)
        except json.JSONDecodeError:
            conf[key] = raw
    if any(k in conf for k in DATA_FIELDS):  # other data: the accuracy target may not fit its task
        return conf
    return {**DEMO_CONF, **conf}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a DAG Param")
    args = parser.parse_args()
    try:
        conf = run_conf(args.set)
    except ValueError as e:
        parser.error(str(e))
    # A name that is not a Param would be ignored by the run: refused before anything runs.
    from training_airflow.conf_check import unknown_fields_error
    from training_airflow.params import training_params

    if error := unknown_fields_error(conf, training_params(), dag_id="distributed_training"):
        print(f"demo.py: --set: {error}", file=sys.stderr)
        return 2

    from training_airflow import settings

    tracking_uri = settings.ensure_tracking_uri()
    dataset = Path(settings.resolve_path(settings.default_dataset_uri()))
    setup = {}
    if "dataset_uri" not in conf and not (dataset / "dataset.json").exists():  # never write into a user's folder
        print(f"==> making the demo dataset in {dataset}")
        setup["make-data"] = subprocess.Popen([sys.executable, "-m", "training", "make-data", "--out", str(dataset)])
    print("==> preparing the Airflow metadata DB (SQLite, project-local) and the MLflow store")
    # The venv's own CLI: `make demo` does not put .venv/bin on PATH.
    setup["airflow db migrate"] = subprocess.Popen([str(Path(sys.executable).parent / "airflow"), "db", "migrate"],
                                                   stdout=subprocess.DEVNULL)
    from training.tracking.run import get_or_create_experiment

    get_or_create_experiment(conf.get("experiment", "distributed_training"))  # the store's tables, once
    dag = _load_dag("distributed_training")
    api = _execution_api()
    for name, proc in setup.items():
        if proc.wait() != 0:
            print(f"{name} failed (exit {proc.returncode})")
            return 1
    api.get("/health")  # its first request starts the app (about 2.5 s): before the DAG run, not in its first task

    print("==> running one DAG run of distributed_training (tasks stream their logs below)")
    from training_airflow.inprocess_logs import task_logs_to_files

    t0 = time.perf_counter()
    with task_logs_to_files():
        dag_run = dag.test(run_conf=conf)
    wall = time.perf_counter() - t0
    state = str(getattr(dag_run, "state", "unknown"))

    from mlflow.tracking import MlflowClient

    from training.tracking.run import experiment_url, run_url, summary_of
    from training_airflow.links import airflow_run_url

    client = MlflowClient()
    experiment = conf.get("experiment", "distributed_training")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run.run_id}'") if exp else []
    print()
    print("=" * 78)
    print(f"DAG run      : {dag_run.run_id}  state={state}  ({wall:.1f}s in dag.test)")
    print(f"Tasks        : {_task_times(dag_run)}")
    if not runs:
        print("No MLflow run was opened: the first task failed. Read its log above.")
        return 1
    run = runs[0]
    m, tags, summary = run.data.metrics, run.data.tags, summary_of(run)
    ui = settings.mlflow_ui_url()
    print(f"MLflow run   : {run.info.run_name}  ({run.info.run_id})  status={run.info.status}  experiment={experiment}")
    print(f"Tracking URI : {tracking_uri}")
    print(f"MLflow UI    : make mlflow-ui   then  {run_url(ui, exp.experiment_id, run.info.run_id)}")
    print(f"  all runs   : {experiment_url(ui, exp.experiment_id)}")
    print(f"Airflow UI   : make airflow-up  then  {airflow_run_url(dag_run.dag_id, dag_run.run_id)}  (task logs, link to MLflow)")
    print(f"Checkpoint   : {tags.get('checkpoint.uri', '(not uploaded)')}")
    figures = [f"{k.removeprefix('eval/')} {m[k]:.4f}" for k in ("eval/bits_per_byte", "eval/perplexity", "eval/accuracy",
                                                                 "eval/r2", "eval/rmse", "eval/loss") if k in m]
    if figures:
        print(f"Evaluation   : {', '.join(figures)}")
    if "train/loss" in m:
        print(f"Training     : last train/loss {m['train/loss']:.4f}, perf/samples_per_s {m.get('perf/samples_per_s', 0):.0f}, "
              f"comm/s_per_step {1000 * m.get('comm/s_per_step', 0):.2f} ms")
    if conf.get("target_metric", "none") != "none":
        from training.config.train_config import higher_is_better

        pick = max if higher_is_better(conf["target_metric"]) else min
        best = pick((x.value for x in client.get_metric_history(run.info.run_id, conf["target_metric"])), default=None)
        reached = (f"reached at step {summary['steps_to_target']:.0f}, {summary['time_to_target_s']:.1f}s after "
                   "training started" if "time_to_target_s" in summary
                   else "not reached" + (f" (best {best:.4f})" if best is not None else ""))
        print(f"Target       : {conf['target_metric']} {conf['target_value']} {reached}")
    if "startup/total_s" in m:
        phases = ", ".join(f"{k[len('startup/'):-2]} {v:.1f}s" for k, v in m.items()
                           if k.startswith("startup/") and k != "startup/total_s" and v >= 0.05)
        print(f"Start-up     : rank 0 at its first step {m['startup/total_s']:.1f}s after its process started ({phases})")
    if "torchrun_wall_s" in summary:
        print(f"Timing       : torchrun {summary['torchrun_wall_s']:.1f}s, DAG {summary.get('dag_wall_s', 0):.1f}s, "
              f"orchestration overhead {summary.get('orchestration_overhead_s', 0):.1f}s")
    if "failure.reason" in tags:
        print(f"Failed       : {tags.get('failure.task', '?')}: {tags['failure.reason']}")
    print("=" * 78)
    return 0 if state.endswith("success") else 1


if __name__ == "__main__":
    sys.exit(main())
