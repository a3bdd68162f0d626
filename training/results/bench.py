"""Benchmark sweep: world size x strategy x precision x comm_hook x DDP bucket size, one child
MLflow run per point under one parent run, then the comparison report (training/results/compare.py)
logged to the parent and a table of each point's medians printed.

    python -m training bench --dataset-uri var/data/teacher --worlds 1 2 --strategies ddp fsdp \\
        --precisions fp32 bf16 --comm-hooks none fp16 --steps 100 --out var/bench

Each point is a real ``torchrun`` launch of ``python -m training train`` logging into its child run
(tag ``mlflow.parentRunId``, so the UI nests them). Points the trainer would refuse (fp16 or a comm
hook with fsdp, bf16 compression without CUDA) are skipped with the reason before anything starts;
run again with the same parent and finished points are not run twice. ``--repeats N`` runs the grid
N times, one round after another, so a drift in the machine's load hits every point alike; the
table shows the median over the rounds of each run's median after its warm-up window.
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.distributed.launch import torchrun_command
from training.util import free_port

TAG_PARENT = "mlflow.parentRunId"
TAG_POINT = "bench.point"


@dataclass(kw_only=True)
class Point:
    world_size: int
    strategy: str
    precision: str
    comm_hook: str
    bucket_cap_mb: float = TrainConfig.bucket_cap_mb  # DDP only
    round: int = 1  # of --repeats

    @property
    def setting(self) -> str:
        """The point without its round: what the summary table groups by (the bucket size only
        where it is not the trainer's default)."""
        bucket = f"-b{self.bucket_cap_mb:g}" if self.strategy == "ddp" and self.bucket_cap_mb != TrainConfig.bucket_cap_mb else ""
        return f"ws{self.world_size}-{self.strategy}-{self.precision}-{self.comm_hook}{bucket}"

    @property
    def key(self) -> str:
        return self.setting + (f"-r{self.round}" if self.round > 1 else "")


def grid(worlds, strategies, precisions, comm_hooks, *, base: dict[str, Any], cuda: bool,
         bucket_caps=(TrainConfig.bucket_cap_mb,), repeats: int = 1) -> tuple[list[Point], list[str]]:
    """The points to run, round after round, and a line per point skipped (why the trainer would
    refuse it). The bucket size is a DDP setting: FSDP points take the first one only."""
    points, skipped = [], []
    for ws, st, pr, hook, cap in itertools.product(worlds, strategies, precisions, comm_hooks, bucket_caps):
        if st != "ddp" and cap != bucket_caps[0]:
            continue
        p = Point(world_size=int(ws), strategy=st, precision=pr, comm_hook=hook, bucket_cap_mb=float(cap))
        try:
            cfg = TrainConfig(**{**base, "strategy": st, "precision": pr, "comm_hook": hook, "bucket_cap_mb": cap})
            cfg.check_world_size(p.world_size)
            cfg.check_device(cuda)
        except ConfigError as e:
            skipped.append(f"{p.key}: {e}")
            continue
        points.append(p)
    return [Point(**{**vars(p), "round": r}) for r in range(1, repeats + 1) for p in points], skipped


def _torchrun(point: Point, sets: dict[str, Any], env: dict[str, str], log: Path) -> int:
    cmd = torchrun_command([a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
                           nproc_per_node=point.world_size, master_port=free_port())
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              cwd=Path(__file__).resolve().parents[2]).returncode


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
                "bucket_cap_mb": p.bucket_cap_mb, "checkpoint_dir": folder / "checkpoints",
                "output_dir": folder / "output"}
        env = {**os.environ, "MLFLOW_RUN_ID": child, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        env.setdefault("OMP_NUM_THREADS", "1")
        echo(f"bench {p.key}: training (child run {child}, log {folder / 'train.log'})")
        rc = _torchrun(p, sets, env, folder / "train.log")
        status = "FINISHED" if rc == 0 else "FAILED"
        client.set_terminated(child, status)
        if rc != 0:
            echo(f"bench {p.key}: FAILED (exit {rc}); last lines:\n" + "\n".join(
                (folder / "train.log").read_text().splitlines()[-15:]))
        results.append({"point": p.key, "setting": p.setting, "run_id": child, "status": status})
    return results


SUMMARY = ("perf/samples_per_s", "comm/collectives_per_step", "comm/s_per_step", "comm/exposed_s_per_step",
           "comm/exposed_fraction")


def _after_warmup(client, run_id: str, key: str) -> float | None:
    """Median of a metric over a run's log windows after the first (warm-up) one."""
    values = [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)][1:]
    return statistics.median(values) if values else None


def _final(client, run_id: str, key: str) -> float | None:
    """A run's last value of a metric (None when it never logged it)."""
    return client.get_run(run_id).data.metrics.get(key)


def summarize(results: list[dict[str, Any]], client=None) -> dict[str, dict[str, float]]:
    """Per setting (a point without its round): the median over its finished rounds of each
    ``SUMMARY`` figure, plus ``exposed/comm``, the share of the time a gradient collective was in
    flight that the step waited for it (1: none of it hidden behind backward compute); and, where
    logged, the median over rounds of ``time_to_target_s`` and of the final ``eval/accuracy``."""
    from mlflow.tracking import MlflowClient

    client = client or MlflowClient()
    per_setting: dict[str, list[dict[str, float]]] = {}
    for r in results:
        if r["status"] == "FINISHED":
            figures = {k: _after_warmup(client, r["run_id"], k) for k in SUMMARY}
            per_setting.setdefault(r.get("setting", r["point"]), []).append({k: v for k, v in figures.items() if v is not None})
    out = {}
    for setting, rounds in per_setting.items():
        med = {k: statistics.median(x[k] for x in rounds if k in x) for k in SUMMARY if any(k in x for x in rounds)}
        for key in ("time_to_target_s", "eval/accuracy"):
            values = [v for v in (_final(client, r["run_id"], key) for r in results
                                  if r.get("setting", r["point"]) == setting and r["status"] == "FINISHED") if v is not None]
            if values:
                med[key] = statistics.median(values)
        if med.get("comm/s_per_step") and "comm/exposed_s_per_step" in med:
            med["exposed/comm"] = med["comm/exposed_s_per_step"] / med["comm/s_per_step"]
        out[setting] = {**med, "rounds": float(len(rounds))}
    return out


def summary_table(summary: dict[str, dict[str, float]]) -> str:
    head = (f"{'setting':<34} {'samples/s':>10} {'collectives':>11} {'comm ms':>8} {'exposed ms':>10} "
            f"{'exposed/comm':>12} {'exposed/step':>12} {'to target s':>11} {'eval acc':>8}")
    rows = [head]
    for setting, m in summary.items():
        def f(key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
            return format(m[key] * scale, fmt) if key in m else "-"
        rows.append(f"{setting:<34} {f('perf/samples_per_s', fmt='.0f'):>10} {f('comm/collectives_per_step', fmt='.0f'):>11} "
                    f"{f('comm/s_per_step', 1000):>8} {f('comm/exposed_s_per_step', 1000):>10} "
                    f"{f('exposed/comm', fmt='.2f'):>12} {f('comm/exposed_fraction', fmt='.3f'):>12} "
                    f"{f('time_to_target_s'):>11} {f('eval/accuracy', fmt='.4f'):>8}")
    return "\n".join(rows)


def report(*, experiment: str, parent_run_id: str, out: Path) -> dict[str, Any]:
    """The comparison report of the parent's finished children, logged to the parent run."""
    from mlflow.tracking import MlflowClient

    from training.results.compare import write_report

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

    from training.tracking.run import get_or_create_experiment

    base = {"dataset_uri": a.dataset_uri, "model": a.model, "steps": a.steps, "batch_size": a.batch_size,
            "log_every": a.log_every, "checkpoint_every": 0, "eval_every": a.eval_every,
            **{k: getattr(a, k) for k in ("hidden", "depth", "n_heads") if getattr(a, k) is not None}}
    if a.target_metric != "none":
        base.update(target_metric=a.target_metric, target_value=a.target_value)
    TrainConfig(**base)  # refuse a bad base config before anything starts
    points, skipped = grid(a.worlds, a.strategies, a.precisions, a.comm_hooks, base=base,
                           cuda=torch.cuda.is_available(), bucket_caps=a.bucket_caps, repeats=a.repeats)
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
        "grid.comm_hooks": a.comm_hooks, "grid.bucket_caps": a.bucket_caps, "grid.repeats": a.repeats,
        "model": a.model, "steps": a.steps, "batch_size": a.batch_size}.items()])
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-"))
    results = run_sweep(experiment=a.experiment, parent_run_id=parent, points=points, base=base, work=out / "points")
    failed = [r for r in results if r["status"] != "FINISHED"]
    rep = report(experiment=a.experiment, parent_run_id=parent, out=out / "report")
    client.set_terminated(parent, "FAILED" if failed else "FINISHED")
    print(summary_table(summarize(results, client)))
    print(f"bench: {len(results) - len(failed)}/{len(results)} points finished; parent run {parent}; "
          f"report {rep['report_md']}")
    return 1 if failed else 0
