"""Benchmark sweep: world size x strategy x precision x comm_hook, one child MLflow run per point
under one parent run, then the comparison report (training.compare) logged to the parent.

    python -m training bench --dataset-uri var/data/teacher --worlds 1 2 --strategies ddp fsdp \\
        --precisions fp32 bf16 --comm-hooks none fp16 --steps 100 --out var/bench

Each point is a real ``torchrun`` launch of ``python -m training train`` whose rank 0 logs into
its child run (``MLFLOW_RUN_ID``); children carry the tag ``mlflow.parentRunId`` so the MLflow UI
nests them. Points the trainer would refuse (fp16 with fsdp, a comm hook with fsdp, bf16
compression without CUDA) are skipped with the reason, before anything starts. Run again with the
same parent and finished points are not run twice.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import ConfigError, TrainConfig
from training.launch import torchrun_command
from training.util import free_port

TAG_PARENT = "mlflow.parentRunId"
TAG_POINT = "bench.point"


@dataclass(kw_only=True)
class Point:
    world_size: int
    strategy: str
    precision: str
    comm_hook: str

    @property
    def key(self) -> str:
        return f"ws{self.world_size}-{self.strategy}-{self.precision}-{self.comm_hook}"


def grid(worlds, strategies, precisions, comm_hooks, *, base: dict[str, Any], cuda: bool) -> tuple[list[Point], list[str]]:
    """The points to run and a line per point skipped (why the trainer would refuse it)."""
    points, skipped = [], []
    for ws, st, pr, hook in itertools.product(worlds, strategies, precisions, comm_hooks):
        p = Point(world_size=int(ws), strategy=st, precision=pr, comm_hook=hook)
        try:
            cfg = TrainConfig(**{**base, "strategy": st, "precision": pr, "comm_hook": hook})
            cfg.check_world_size(p.world_size)
            cfg.check_device(cuda)
        except ConfigError as e:
            skipped.append(f"{p.key}: {e}")
            continue
        points.append(p)
    return points, skipped


def _torchrun(point: Point, sets: dict[str, Any], env: dict[str, str], log: Path) -> int:
    cmd = torchrun_command([a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
                           nproc_per_node=point.world_size, master_port=free_port())
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              cwd=Path(__file__).resolve().parents[1]).returncode


def run_sweep(*, experiment: str, parent_run_id: str, points: list[Point], base: dict[str, Any], work: Path,
              echo=print) -> list[dict[str, Any]]:
    """Run every point as a child run of ``parent_run_id``; returns one record per point."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp_id = client.get_run(parent_run_id).info.experiment_id
    existing = {r.data.tags.get(TAG_POINT): r for r in client.search_runs(
        [exp_id], filter_string=f"tags.`{TAG_PARENT}` = '{parent_run_id}'", max_results=1000)}
    results = []
    for p in points:
        prev = existing.get(p.key)
        if prev is not None and prev.info.status == "FINISHED":
            echo(f"bench {p.key}: already finished in run {prev.info.run_id}")
            results.append({"point": p.key, "run_id": prev.info.run_id, "status": "FINISHED"})
            continue
        child = prev.info.run_id if prev is not None else client.create_run(
            exp_id, run_name=p.key, tags={TAG_PARENT: parent_run_id, TAG_POINT: p.key}).info.run_id
        folder = work / p.key
        folder.mkdir(parents=True, exist_ok=True)
        sets = {**base, "strategy": p.strategy, "precision": p.precision, "comm_hook": p.comm_hook,
                "checkpoint_dir": folder / "checkpoints", "output_dir": folder / "output"}
        env = {**os.environ, "MLFLOW_RUN_ID": child, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        env.setdefault("OMP_NUM_THREADS", "1")
        echo(f"bench {p.key}: training (child run {child}, log {folder / 'train.log'})")
        rc = _torchrun(p, sets, env, folder / "train.log")
        status = "FINISHED" if rc == 0 else "FAILED"
        client.set_terminated(child, status)
        if rc != 0:
            echo(f"bench {p.key}: FAILED (exit {rc}); last lines:\n" + "\n".join(
                (folder / "train.log").read_text().splitlines()[-15:]))
        results.append({"point": p.key, "run_id": child, "status": status})
    return results


def report(*, experiment: str, parent_run_id: str, out: Path) -> dict[str, Any]:
    """The comparison report of the parent's finished children, logged to the parent run."""
    from mlflow.tracking import MlflowClient

    from training.compare import write_report

    client = MlflowClient()
    exp_id = client.get_run(parent_run_id).info.experiment_id
    children = client.search_runs([exp_id], filter_string=f"tags.`{TAG_PARENT}` = '{parent_run_id}' "
                                  "and attributes.status = 'FINISHED'", order_by=["attributes.start_time ASC"],
                                  max_results=1000)
    result = write_report(experiment, out, run_ids=[r.info.run_id for r in children], client=client)
    client.log_artifacts(parent_run_id, str(out), "comparison")
    return result


def main(a) -> int:
    """`python -m training bench` (arguments parsed in training.cli)."""
    import torch
    from mlflow.tracking import MlflowClient

    from training.tracking import get_or_create_experiment

    base = {"dataset_uri": a.dataset_uri, "model": a.model, "steps": a.steps, "batch_size": a.batch_size,
            "log_every": a.log_every, "checkpoint_every": 0, "eval_every": a.eval_every}
    if a.target_metric != "none":
        base.update(target_metric=a.target_metric, target_value=a.target_value)
    TrainConfig(**base)  # refuse a bad base config before anything starts
    points, skipped = grid(a.worlds, a.strategies, a.precisions, a.comm_hooks, base=base,
                           cuda=torch.cuda.is_available())
    for line in skipped:
        print(f"bench: skipped {line}")
    if not points:
        raise ConfigError("--strategies/--precisions/--comm-hooks", "no point of the grid can run",
                          "see the skipped points above and choose a valid combination")
    client = MlflowClient()
    exp_id = get_or_create_experiment(a.experiment)
    parent = a.parent_run_id or client.create_run(exp_id, run_name=a.run_name or "benchmark sweep").info.run_id
    from mlflow.entities import Param

    client.log_batch(parent, params=[Param(k, str(v)) for k, v in {
        "grid.worlds": a.worlds, "grid.strategies": a.strategies, "grid.precisions": a.precisions,
        "grid.comm_hooks": a.comm_hooks, "model": a.model, "steps": a.steps, "batch_size": a.batch_size}.items()])
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-"))
    results = run_sweep(experiment=a.experiment, parent_run_id=parent, points=points, base=base, work=out / "points")
    failed = [r for r in results if r["status"] != "FINISHED"]
    rep = report(experiment=a.experiment, parent_run_id=parent, out=out / "report")
    client.set_terminated(parent, "FAILED" if failed else "FINISHED")
    print(f"bench: {len(results) - len(failed)}/{len(results)} points finished; parent run {parent}; "
          f"report {rep['report_md']}")
    return 1 if failed else 0
