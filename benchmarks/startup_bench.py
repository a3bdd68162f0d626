"""Where users wait: orchestration and start-up overhead of a training run, measured three ways.

    .venv/bin/python benchmarks/startup_bench.py                      # all three parts
    .venv/bin/python benchmarks/startup_bench.py --parts torchrun --repeats 5

- ``demo``: ``scripts/demo.py`` (what ``make demo`` runs) in fresh folders, ``--repeats`` times: the
  first run is a fresh clone's (new Airflow DB, new MLflow store, dataset made), the others are
  second runs. Prints DAG wall, torchrun wall, their difference (goal <= 10 s) and each task's time.
- ``torchrun``: the demo's training alone (its config, 2 ranks, launched by the local backend's
  own ``run_streaming`` with rank 0's MLflow calls relayed, as in the DAG): torchrun wall - training wall (first step's start to last step's end, from steps.jsonl;
  goal <= 5 s), with rank 0's start-up breakdown (the ``startup:`` line the trainer prints).
- ``live``: the real scheduler (``tests/e2e/live_airflow.py``: api-server, scheduler,
  dag-processor, triggerer, LocalExecutor, SQLite) with two trivial DAGs beside ours (one no-op
  task; six chained no-op tasks, the shape of a training run): trigger -> success of a trivial DAG
  (Airflow's own latency) and of ``distributed_training`` with steps=20 (goal <= 40 s), alternating,
  medians; plus where the training run's time went per task (queued -> start, start -> end).

Every figure is printed with the machine's 1-minute load average at the time, because on a shared
machine other work stretches all of them; compare figures taken in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "plugins"))

from training.distributed.launch import torchrun_command  # noqa: E402 (after the path is set)
from training.util import free_port  # noqa: E402

TRIVIAL_DAGS = '''
from datetime import datetime

from airflow.sdk import dag, task


@dag(dag_id="trivial_one", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def trivial_one():
    @task
    def noop():
        return None

    noop()


@dag(dag_id="trivial_chain", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def trivial_chain():
    """Six chained no-op tasks: the shape of a training run, without its work."""

    @task
    def noop(x=None):
        return None

    x = None
    for i in range(6):
        x = noop.override(task_id=f"step_{i}")(x)


trivial_one()
trivial_chain()
'''


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def _med(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"


# ---------------------------------------------------------------------------------------------- demo


def demo_part(repeats: int, work: Path) -> None:
    print("== make demo (scripts/demo.py), fresh folders; run 1 = a fresh clone's first run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "TRAINING_"))}
    env.update(AIRFLOW_HOME=str(work / "airflow"), MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow' / 'mlflow.db'}",
               TRAINING_VAR_DIR=str(work / "var"), AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
               # A fresh machine's caches too: no kept gate verdict, no measured peak FLOP/s yet.
               TRAINING_CACHE_DIR=str(work / "cache"), TRAINING_DATA_CACHE=str(work / "data-cache"),
               AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               PYTHONPATH=os.pathsep.join([str(ROOT / "plugins"), str(ROOT)]), GLOO_SOCKET_IFNAME="lo",
               GX_ANALYTICS_ENABLED="False", MLFLOW_ENABLE_TELEMETRY="false", DO_NOT_TRACK="true")
    overheads = []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        total = time.perf_counter() - t0
        text = out.stdout + out.stderr
        timing = re.search(r"Timing       : torchrun ([0-9.]+)s, DAG ([0-9.]+)s, orchestration overhead ([0-9.]+)s", text)
        if out.returncode != 0 or timing is None:
            print(text[-3000:])
            raise SystemExit(f"demo run {i + 1} failed (exit {out.returncode})")
        torchrun, dag, overhead = (float(x) for x in timing.groups())
        tasks = re.search(r"Tasks        : (.*)", text)
        acc = re.search(r"Evaluation   : accuracy ([0-9.]+)", text)
        overheads.append(overhead) if i else None
        print(f"  run {i + 1} ({'fresh clone' if i == 0 else 'again'}): DAG {dag:.1f} s, torchrun {torchrun:.1f} s, "
              f"DAG - torchrun {overhead:.1f} s (goal <= 10), whole script {total:.1f} s, "
              f"accuracy {acc[1] if acc else '?'}  [{load()}]")
        if tasks:
            print(f"      tasks: {tasks[1]}")
    if overheads:
        print(f"  DAG - torchrun over the repeat runs: {_med(overheads)}")


# ------------------------------------------------------------------------------------------ torchrun


def demo_train_config(dataset: Path, folder: Path) -> dict:
    """The demo's trainer config: the form's defaults (TrainConfig + the deployment's), as the
    DAG's train task writes it to train_config.json."""
    from training.config.train_config import TrainConfig
    from training.config.fields import specs
    from training_airflow.params import deployment_defaults

    values = {name: s.default for name, s in specs(TrainConfig).items()}
    values.update({k: v for k, v in deployment_defaults().items() if k in values})
    values.update(dataset_uri=str(dataset), checkpoint_dir=str(folder / "checkpoints"), output_dir=str(folder / "output"))
    return TrainConfig(**values).to_dict()


def torchrun_part(repeats: int, work: Path, world: int) -> None:
    print(f"== torchrun of the demo's training ({world} ranks, launched and relayed as the DAG's train task does)")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
    from mlflow.tracking import MlflowClient

    import logging

    from training.tracking.relay import RELAY_ENV
    from training_airflow.backends.local import log as launcher_log, rank_env, run_streaming

    launcher_log.setLevel(logging.WARNING)  # the ranks' lines are the task log's, not this report's

    dataset = work / "teacher"
    subprocess.run([sys.executable, "-m", "training", "make-data", "--out", str(dataset)], check=True, cwd=ROOT,
                   capture_output=True)
    client = MlflowClient()
    exp = client.create_experiment("startup_bench", artifact_location=(work / "artifacts").as_uri())
    gaps = []
    for i in range(repeats):
        folder = work / f"torchrun-{i}"
        folder.mkdir()
        (folder / "train_config.json").write_text(json.dumps(demo_train_config(dataset, folder)))
        run_id = client.create_run(exp).info.run_id
        env = rank_env(world, {"MLFLOW_RUN_ID": run_id, RELAY_ENV: "stdout", "PYTHONPATH": str(ROOT)})
        cmd = torchrun_command(["--config", str(folder / "train_config.json")], nproc_per_node=world,
                               master_port=free_port())
        result = run_streaming(cmd, env=env, cwd=ROOT, relay_run_id=run_id)  # the train task's own launcher
        if result.returncode != 0:
            print("\n".join(result.tail[-40:]))
            raise SystemExit(f"torchrun {i + 1} failed (exit {result.returncode})")
        records = [json.loads(line) for line in (folder / "output" / "steps.jsonl").read_text().splitlines()]
        train_wall = records[-1]["t"] - (records[0]["t"] - records[0]["step_s"])
        gaps.append(result.wall_s - train_wall)
        startup = next((line for line in result.tail if line.startswith("startup: ")), None)
        print(f"  run {i + 1}: torchrun {result.wall_s:.2f} s, training (first step to last) {train_wall:.2f} s, "
              f"difference {result.wall_s - train_wall:.2f} s (goal <= 5)  [{load()}]", flush=True)
        if startup:
            print(f"      rank 0 {startup}")
    print(f"  torchrun - training: {_med(gaps)}")


# ---------------------------------------------------------------------------------------------- live


def _when(stamp: str | None) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else float("nan")


def _run_and_wait(af, dag_id: str, conf: dict, timeout: float = 900) -> tuple[float, dict]:
    """Trigger over REST and poll until the run ends; (trigger -> success as the client saw it, run)."""
    t0 = time.perf_counter()
    run_id = af.trigger(dag_id, conf)
    run = af.wait_for_run(dag_id, run_id, timeout=timeout, every=0.2)
    if run["state"] != "success":
        raise SystemExit(f"{dag_id} {run_id} failed: {af.task_states(dag_id, run_id)}")
    return time.perf_counter() - t0, run


def _task_breakdown(af, dag_id: str, run: dict) -> str:
    tis = af.task_instances(dag_id, run["dag_run_id"])
    tis.sort(key=lambda ti: _when(ti["start_date"]))
    parts, prev_end = [], _when(run["queued_at"])
    for ti in tis:
        start, end = _when(ti["start_date"]), _when(ti["end_date"])
        parts.append(f"{ti['task_id']} wait {start - prev_end:.1f} + run {end - start:.1f}")
        prev_end = end
    parts.append(f"end of last task -> run success {_when(run['end_date']) - prev_end:.1f}")
    return "; ".join(parts)


def live_part(repeats: int, work: Path, steps: int) -> None:
    print(f"== live scheduler (LocalExecutor), trigger -> success: trivial DAGs vs distributed_training steps={steps}")
    from tests.e2e.live_airflow import LiveAirflow

    dags = work / "dags"
    dags.mkdir()
    for f in (ROOT / "dags").glob("*.py"):
        (dags / f.name).symlink_to(f)
    (dags / "trivial.py").write_text(TRIVIAL_DAGS)
    os.environ.update(MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow' / 'mlflow.db'}", TRAINING_VAR_DIR=str(work / "var"))
    (work / "mlflow").mkdir()
    dataset = work / "var" / "data" / "teacher"
    subprocess.run([sys.executable, "-m", "training", "make-data", "--out", str(dataset)], check=True, cwd=ROOT,
                   capture_output=True)
    af = LiveAirflow(work / "airflow", extra_env={"TRAINING_SCHEDULE": "none", "AIRFLOW__CORE__DAGS_FOLDER": str(dags)})
    try:
        af.start()
        af.wait_for_dags("distributed_training", "trivial_one", "trivial_chain")
        for d in ("distributed_training", "trivial_one", "trivial_chain"):
            af.unpause(d)
        _run_and_wait(af, "trivial_one", {})  # the first task process of a fresh stack pays one-time costs
        times: dict[str, list[float]] = {"trivial_one": [], "trivial_chain": [], "distributed_training": []}
        for i in range(repeats):
            for dag_id, conf in (("trivial_one", {}), ("trivial_chain", {}), ("distributed_training", {"steps": steps})):
                wall, run = _run_and_wait(af, dag_id, conf)
                times[dag_id].append(wall)
                print(f"  round {i + 1}: {dag_id:22s} trigger -> success {wall:5.1f} s  [{load()}]", flush=True)
                if dag_id == "distributed_training":
                    print(f"      {_task_breakdown(af, dag_id, run)}")
        for dag_id, values in times.items():
            print(f"  {dag_id:22s} {_med(values)}")
        ours, chain = statistics.median(times["distributed_training"]), statistics.median(times["trivial_chain"])
        print(f"  distributed_training - trivial_chain (what our tasks add to Airflow's own scheduling of six "
              f"tasks): {ours - chain:.1f} s; goal: distributed_training <= 40 s")
    finally:
        af.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=["demo", "torchrun", "live"], default=["demo", "torchrun", "live"])
    ap.add_argument("--repeats", type=int, default=3, help="runs per part (rounds for live)")
    ap.add_argument("--world", type=int, default=2, help="ranks of the torchrun part")
    ap.add_argument("--steps", type=int, default=20, help="steps of the live training run")
    a = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, {load()} at the start")
    for part in a.parts:
        with tempfile.TemporaryDirectory(prefix=f"startup-bench-{part}-") as tmp:
            {"demo": lambda: demo_part(a.repeats, Path(tmp)),
             "torchrun": lambda: torchrun_part(a.repeats, Path(tmp), a.world),
             "live": lambda: live_part(a.repeats, Path(tmp), a.steps)}[part]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
