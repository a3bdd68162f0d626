"""A TPE sweep of ``lr`` x ``hidden`` with ASHA against the same trials without pruning.

The sweep's own task bodies (``training_airflow.sweep_tasks``: open_sweep, the data gate, the
lanes, report) run here in one process, without a scheduler: the trials are real torchrun
launches, the study is Optuna's on SQLite, MLflow a SQLite store, all in a temporary folder.
First the ASHA sweep samples and prunes its trials; then the very same trials (their sampled
values, enqueued into a second study in the same order) train to the end with ``pruner=none``.
Printed: steps spent, trials pruned, the best trial's eval/accuracy and the seconds the trials
took (train, commit, evaluate; the first sweep's data gate and set-up are left out).

    .venv/bin/python benchmarks/sweep_bench.py --trials 12 --steps 200 --eval-every 25
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]


def run_sweep(params: dict, dag_run_id: str, enqueue: list[dict] | None = None) -> dict:
    from training.sweep.study import open_study
    from training_airflow import settings, sweep_tasks, tasks

    t0 = time.perf_counter()
    opened = sweep_tasks.open_sweep(params, dag_id="training_sweep", dag_run_id=dag_run_id)
    validated = {**tasks.validate_data(params, opened), "study": opened["study"]}
    if enqueue:  # the other sweep's trials, in its order, before any trial is asked for
        search = sweep_tasks.search_of(params)
        dists = sweep_tasks.check_search({**params, "dataset_uri": validated["dataset_uri"]})
        objective, direction = sweep_tasks._objective(params, validated)
        study = open_study(validated["study"], search, dists, direction=direction, url=settings.sweep_storage_url())
        for values in enqueue:
            study.enqueue_trial(values)
    t1 = time.perf_counter()
    for lane in sweep_tasks.lanes(params, validated):
        sweep_tasks.run_lane(params, lane)
    trials_s = time.perf_counter() - t1
    out = sweep_tasks.report(params, validated)
    return {**out, "wall_s": time.perf_counter() - t0, "trials_s": trials_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    os.environ.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", TRAINING_WORK_DIR=str(tmp / "work"),
                      TRAINING_SWEEP_STORAGE=f"sqlite:///{tmp / 'sweeps.db'}", GLOO_SOCKET_IFNAME="lo",
                      OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "plugins"))
    from training.data.synthetic import make_teacher_dataset
    from training_airflow.sweep_tasks import sweep_params

    data = tmp / "teacher"
    make_teacher_dataset(data, n_train=8_000, n_val=2_000, seed=0)  # the demo's table
    base = {name: p.value for name, p in sweep_params().items()}
    params = {**base, "dataset_uri": str(data), "store_uri": (tmp / "store").as_uri(), "steps": a.steps,
              "eval_every": a.eval_every, "seed": a.seed, "world_size": 1, "trials": a.trials, "max_parallel_trials": 1,
              "sampler": "tpe", "objective": "eval/accuracy",
              "search_space": {"lr": {"low": 1e-4, "high": 3e-2, "log": True}, "hidden": [32, 64, 128]}}
    asha = run_sweep({**params, "pruner": "asha", "experiment": "sweep-asha"}, "bench-asha")

    import optuna

    from training.sweep.study import storage

    study = optuna.load_study(study_name=asha["mlflow_run_id"], storage=storage(os.environ["TRAINING_SWEEP_STORAGE"]))
    sampled = [t.params for t in study.trials]
    full = run_sweep({**params, "pruner": "none", "experiment": "sweep-full"}, "bench-full", enqueue=sampled)
    rows = [("ASHA", asha), ("no pruning", full)]
    print(f"\n{a.trials}-trial TPE sweep of lr x hidden, {a.steps} steps per trial, evaluations every {a.eval_every}:")
    print("| sweep | steps spent | trials pruned | best eval/accuracy | best trial's values | trials' s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {int(r['sweep/steps_spent'])} of {int(r['sweep/steps_without_pruning'])} | "
              f"{int(r['sweep/trials_pruned'])} | {r['best_value']:.4f} | {json.dumps(r['best_params'])} | "
              f"{r['trials_s']:.0f} |")
    print(f"steps: {asha['sweep/steps_spent'] / full['sweep/steps_spent']:.2f}x; trials' time: "
          f"{asha['trials_s'] / full['trials_s']:.2f}x; folder {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
