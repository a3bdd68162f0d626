"""The local backend: ``torchrun`` as a child process of the Airflow task, on the worker.

Task group ``local`` (task ids ``train`` and ``upload_checkpoint``, as before the groups existed):

- ``train``: writes the run's ``train_config.json`` and starts ``torchrun --nproc-per-node world_size``
  in its own process group (command line: training/distributed/launch.py); every output line goes to
  the task log, except rank 0's relayed MLflow calls, which it applies to the run
  (training/tracking/relay.py); a non-zero exit fails the task with the failing rank's error
  (``TrainingFailed``), and no rank outlives the task. With ``checkpoint_location=store`` (default)
  the ranks commit to ``{store_uri}/{experiment}/{mlflow run id}`` and a retry resumes on any worker;
  with ``local`` they write to the work folder and a retry resumes only on this worker.
- ``upload_checkpoint``: hands on the ``Handoff`` of the final commit: reads ``latest`` back and
  checks it names the final step (store), or commits the final checkpoint folder (local).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from airflow.sdk import TaskGroup, task

from training_airflow import settings
from training_airflow.connections import store_env
from training_airflow.failures import fails_fast
from training_airflow.handoff import Handoff, Validated, committed
from training_airflow.mlflow_run import run_logger
from training_airflow.run_config import train_config

log = logging.getLogger(__name__)
PARAMS = None  # no fields of its own: world_size and max_restarts are the run's


class TrainingFailed(RuntimeError):
    """torchrun failed; ``reason`` is the one line that says why, ``tail`` its last output lines."""

    def __init__(self, message: str, *, reason: str, tail: list[str]):
        super().__init__(message)
        self.reason, self.tail = reason, "\n".join(tail) + "\n"


@dataclass
class LaunchResult:
    returncode: int
    wall_s: float
    tail: list[str]


def check_params(params: dict[str, Any]) -> int:
    """The trainer's rules for this run (cross-field, world size, dataset kind)."""
    train_config(params)
    return int(params["world_size"])


def memory_budget(params: dict[str, Any]) -> tuple[Any, int]:
    """This worker's memory (its cgroup limit, else MemAvailable) less what runs on it and the
    torchrun agent to come, split between ``world_size`` ranks; on CUDA the ranks check their GPU."""
    from training.metrics.memory import AGENT_CPU
    from training.metrics.preflight import local_budget

    world = int(params["world_size"])
    return (None if cuda_available() else local_budget(world, agent=AGENT_CPU)), world


def rank_env(nproc: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback only; nccl ignores it
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch (slow: docs/benchmarks.md) on a worker
    that has no NVIDIA driver at all."""
    if not (Path("/proc/driver/nvidia").exists() or any(Path("/dev").glob("nvidia[0-9]*"))):
        return False
    import torch

    return torch.cuda.is_available()


def run_streaming(cmd: list[str], *, env: dict[str, str], cwd: str | Path, tail_lines: int = 200,
                  relay_run_id: str | None = None) -> LaunchResult:
    """Run ``cmd`` in its own process group, log each output line, kill the group on exit.

    With ``relay_run_id`` the lines rank 0 relays (``training.tracking.relay.RelayLogger``) are applied
    to that MLflow run here instead of being logged; the ranks are started first, so this
    process's MLflow set-up overlaps their start."""
    log.info("launching: %s", " ".join(cmd))
    t0 = time.perf_counter()
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent)
    relay = None
    try:
        if relay_run_id is not None:
            from training.tracking.relay import RelayReceiver

            relay = RelayReceiver(relay_run_id)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if relay is not None and relay.handle(line):
                continue
            tail.append(line)
            log.info("%s", line)
        rc = proc.wait()
    finally:
        # The task may be stopped (timeout, mark-failed, SIGTERM): never leave ranks behind.
        if proc.poll() is None:
            _stop_group(proc)
        if relay is not None:
            relay.close()
    return LaunchResult(returncode=rc, wall_s=time.perf_counter() - t0, tail=list(tail))


def _die_with_parent() -> None:
    """In the torchrun agent, before it starts: SIGTERM it when the task process dies, even by
    SIGKILL (a lost worker, an out-of-memory kill), which runs no ``finally``. The agent then stops
    its ranks as on any SIGTERM, so a retried task never trains beside an orphaned group."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):  # not Linux: the finally below still covers a normal exit
        pass


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def explain_failure(result: LaunchResult) -> TrainingFailed:
    """Pick the lines a person needs: the Python error of the failing rank and torchrun's summary."""
    errors = [l for l in result.tail if "Error" in l or "error:" in l or "exitcode" in l or "rank" in l.lower()]
    picked = errors[-12:] or result.tail[-12:]
    message = (f"torchrun exited with code {result.returncode} after {result.wall_s:.1f}s. Last relevant lines:\n  "
               + "\n  ".join(picked))
    return TrainingFailed(message, reason=failure_reason(result), tail=result.tail)


def failure_reason(result: LaunchResult) -> str:
    """One line: torchrun's root cause (the first rank that failed: exit code or signal) and the
    trainer's own attribution (``rank R/W: PHASE failed at step S: ...``, e.g. the collective a
    surviving rank was in when its peer died), else the last error line."""
    summary: dict[str, str] = {}
    cause = next((i for i, l in enumerate(result.tail) if "Root Cause" in l), None)
    for line in result.tail[cause:] if cause is not None else []:  # "  rank      : 1 (local_rank: 1)" ...
        key, sep, value = line.strip().partition(":")
        if sep and key.strip() in ("rank", "exitcode", "traceback") and key.strip() not in summary:
            summary[key.strip()] = value.strip()
    attribution = next((l[l.index("rank "):].strip() for l in reversed(result.tail)
                        if "failed at step" in l and "rank " in l), None)
    parts = []
    if "rank" in summary:
        parts.append(f"rank {summary['rank'].split()[0]} exited with {summary.get('exitcode', '?').split()[0]} "
                     f"({summary.get('traceback', 'no traceback')})")
    if attribution:
        parts.append(attribution)
    if not parts:
        errors = [l.strip() for l in result.tail if "Error" in l]
        parts.append(errors[-1] if errors else "no error line in its output")
    return f"torchrun exited with code {result.returncode}: " + "; ".join(parts)


def record_ranks(run_id: str, output_dir: Path) -> dict[str, str]:
    """After a failed launch: each rank's last completed step (its heartbeat) and what it was doing
    when it failed, as tags and ``failures/ranks.json`` in the MLflow run. A rank with a heartbeat
    and no failure record raised nothing: it was killed or it hung; its peers' records name the
    collective they were waiting in."""
    from training.distributed.resilience import RankRecord

    ranks = RankRecord.read(output_dir)
    if not ranks:
        return {}
    silent = [r for r in ranks if r["failure"] is None]
    phases = sorted({r["failure"]["phase"] for r in ranks if r["failure"]})
    tags = {"failure.last_steps": ", ".join(f"rank {r['rank']}: {r['last_step']}" for r in ranks),
            "failure.rank": ", ".join(str(r["rank"]) for r in (silent or ranks)),
            "failure.collective": ", ".join(phases) or "none recorded"}
    if silent:
        tags["failure.rank"] += " (raised nothing: killed or hung)"
    logger = run_logger(run_id)
    logger.set_tags(tags)
    logger.log_text(json.dumps(ranks, indent=2), "failures/ranks.json")
    log.error("ranks at the failure: %s", "; ".join(f"{k}={v}" for k, v in tags.items()))
    return tags


@fails_fast
def run_torchrun(params: dict[str, Any], validated: Validated, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start torchrun with ``world_size`` ranks; a retry resumes from the newest checkpoint that verifies.
    ``extra_env``: more environment of the ranks (a sweep trial's study)."""
    from training.distributed.launch import torchrun_command
    from training.metrics.live import DAG_RUN_ENV, EXPERIMENT_ENV
    from training.tracking.relay import RELAY_ENV
    from training.util import free_port

    settings.ensure_tracking_uri()
    run_id = validated["mlflow_run_id"]
    run_dir = settings.work_dir(run_id)
    cfg = train_config(params, dataset_uri=validated["dataset_uri"], checkpoint_dir=checkpoint_dir(params, run_id),
                               output_dir=str(run_dir / "output"), dataset_fingerprint=validated["dataset_fingerprint"],
                               token_shards=validated.get("token_shards", ""))
    cfg.check_device(cuda_available())  # the ranks run on this machine: refuse what it cannot do
    default_host = type(cfg).__dataclass_fields__["metrics_host"].default
    cfg.metrics_host = settings.local_metrics_host(cfg.metrics_host, default_host)
    config_path = run_dir / "train_config.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    nproc = int(params["world_size"])
    cmd = torchrun_command(["--config", str(config_path)], nproc_per_node=nproc,
                           max_restarts=int(params["max_restarts"]), master_port=free_port())
    # S3 settings of aws_conn_id (if any) travel as environment of the ranks, never as arguments:
    # the ranks read an s3:// dataset with them too. Rank 0's MLflow calls come back through
    # stdout and are applied by this process's client.
    # The ranks' metric labels: the experiment and the DAG run (Airflow sets AIRFLOW_CTX_* for the task).
    env = rank_env(nproc, {**store_env(params), "MLFLOW_RUN_ID": run_id, EXPERIMENT_ENV: str(params["experiment"]),
                           DAG_RUN_ENV: os.environ.get("AIRFLOW_CTX_DAG_RUN_ID", ""),
                           "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"], RELAY_ENV: "stdout",
                           **(extra_env or {})})
    result = run_streaming(cmd, env=env, cwd=settings.PROJECT_ROOT, relay_run_id=run_id)
    if result.returncode != 0:
        record_ranks(run_id, run_dir / "output")
        raise explain_failure(result)

    summary = json.loads((run_dir / "output" / "train_summary.json").read_text())
    run_logger(run_id).log_summary({"torchrun_wall_s": result.wall_s})
    return {**validated, "checkpoint_uri": summary["checkpoint_uri"], "final_step": summary["final_step"],
            "torchrun_wall_s": result.wall_s, "pruned_at": summary.get("pruned_at")}


def checkpoint_dir(params: dict[str, Any], run_id: str) -> str:
    """Where the ranks write checkpoints: the run's place in the store, or the worker's work folder."""
    from training.checkpoint.commit import run_uri

    if params.get("checkpoint_location", "store") == "store":  # a Param an older deployment lacks: the default
        return run_uri(params["store_uri"], params["experiment"], run_id)
    return str(settings.work_dir(run_id) / "checkpoints")


@fails_fast
def commit(params: dict[str, Any], trained: dict[str, Any]) -> Handoff:
    """The committed final checkpoint: read back from the store when the ranks committed it, else
    committed now (objects, then manifest.json, then `latest`)."""
    from training.checkpoint.commit import read_commit, run_location, upload_checkpoint
    from training.store.base import StoreError

    run_id, step = trained["mlflow_run_id"], trained["final_step"]
    logger = run_logger(run_id)
    in_store = params.get("checkpoint_location", "store") == "store"
    try:
        if in_store:
            latest = read_commit(run_location(params["store_uri"], params["experiment"], run_id,
                                              store_env(params)))
            if latest["step"] != step:
                raise StoreError(f"`latest` names step {latest['step']}, not the final step {step}")
            uri = latest["uri"]
            log.info("committed by the ranks: %s", uri)
        else:
            c = upload_checkpoint(urlparse(trained["checkpoint_uri"]).path, params["store_uri"],
                                  experiment=params["experiment"], run_id=run_id, env=store_env(params))
            uri = c.uri
            log.info("committed %s (%d objects uploaded, %d already there) in %.2fs", uri, c.uploaded, c.skipped,
                     c.seconds)
            logger.log_summary({"upload_s": c.seconds})
    except StoreError as e:
        raise RuntimeError(f"checkpoint {'commit check' if in_store else 'upload'} failed: {e}") from None
    logger.set_tags({"checkpoint.uri": uri})
    return committed(trained, checkpoint_uri=uri, final_step=step, torchrun_wall_s=trained["torchrun_wall_s"])


def train_and_commit(validated: Any) -> Any:
    """Task group ``local``: train -> upload_checkpoint. Returns the XComArg of the Handoff."""
    with TaskGroup("local", prefix_group_id=False, tooltip="torchrun on the Airflow worker, then the commit"):

        @task
        def train(validated: dict, params=None) -> dict:
            return run_torchrun(params, validated)

        @task
        def upload_checkpoint(trained: dict, params=None) -> dict:
            return commit(params, trained)

        return upload_checkpoint(train(validated))
