"""Killed workers and a restarted scheduler, against the live Airflow on 127.0.0.1 (LocalExecutor):
the train task's retry resumes from its latest checkpoint, the run succeeds into one MLflow run
with one value per step, and the final model is bit-identical to an uninterrupted run's.

Nothing here is played: the task process and its supervisor (the executor's worker) are really
SIGKILLed, the scheduler is really stopped (SIGTERM to it and everything it started, as a service
manager does) and started again; Airflow notices the lost task by its missing heartbeat
(`task_instance_heartbeat_timeout` is 40 s in this stack) and retries it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from training.distributed.launch import torchrun_command
from training.checkpoint.commit import read_pointer, run_location
from training.util import free_port

pytestmark = pytest.mark.slow

TRAIN = "distributed_training"
STEPS, EVERY = 120, 40


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} not seen after {timeout}s")


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # a zombie is dead
    except OSError:
        return False


def _torchrun_of(config: Path) -> int | None:
    """The torchrun agent started for this run's train_config.json (its cmdline names the file)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" in args and str(config).encode() in args:
            return int(entry.name)
    return None


def _start(af, dataset, tmp_root, experiment: str) -> tuple[str, Path, Path]:
    af.wait_for_dags(TRAIN)
    af.unpause(TRAIN)
    conf = {"dataset_uri": str(dataset), "experiment": experiment, "world_size": 2, "steps": STEPS,
            "checkpoint_every": EVERY, "eval_every": 0, "store_uri": (tmp_root / f"{experiment}-store").as_uri()}
    run_id = af.trigger(TRAIN, conf)
    states = lambda: af.task_states(TRAIN, run_id)  # noqa: E731
    _wait(lambda: states().get("validate_data") == "success", 300, "validate_data success")
    mlflow_run_id = af.xcom(TRAIN, run_id, "validate_data")["mlflow_run_id"]
    run_dir = tmp_root / "var" / "work" / mlflow_run_id
    # The ranks commit every checkpoint to the store (checkpoint_location=store, the default).
    location = run_location(conf["store_uri"], experiment, mlflow_run_id)
    # Killed after the first periodic checkpoint is committed and before the last step.
    _wait(lambda: (read_pointer(location) or {}).get("step", 0) >= EVERY, 600, "the first committed checkpoint")
    return run_id, run_dir, Path(location.uri().removeprefix("file://"))


def _check_recovered(af, run_id: str, run_dir: Path, committed: Path, tries: int | None = None) -> None:
    run = af.wait_for_run(TRAIN, run_id, timeout=900)
    assert run["state"] == "success", af.task_states(TRAIN, run_id)
    if tries is not None:
        assert af.try_numbers(TRAIN, run_id)["train"] == tries
        log = af.task_log(TRAIN, run_id, "train", try_number=tries)
        assert "resuming from" in log, log[-3000:]
    client = MlflowClient()
    exp = client.get_experiment_by_name(run["conf"]["experiment"])
    (mlrun,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{run_id}'")
    assert mlrun.info.status == "FINISHED"
    for key in mlrun.data.metrics:
        steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))

    # The same config trained without interruption gives the same bytes.
    ref = run_dir.parent / f"{run_dir.name}-uninterrupted"
    cmd = torchrun_command(["--config", str(run_dir / "train_config.json"), "--set", f"checkpoint_dir={ref / 'ck'}",
                            "--set", f"output_dir={ref / 'out'}"], nproc_per_node=2, master_port=free_port())
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    out = subprocess.run(cmd, capture_output=True, text=True, env={**env, "GLOO_SOCKET_IFNAME": "lo"}, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    def sha(folder: Path) -> str:
        return hashlib.sha256((folder / f"step_{STEPS:08d}" / "model.safetensors").read_bytes()).hexdigest()

    assert sha(committed) == sha(ref / "ck")


@pytest.mark.budget(360, reason="a DAG run whose worker is killed after a checkpoint, then the retry that resumes it")
def test_a_lost_worker_is_retried_and_resumes_from_its_checkpoint(live_airflow, dataset, tmp_root):
    af = live_airflow
    run_id, run_dir, committed = _start(af, dataset, tmp_root, "live-lost-worker")
    agent = _torchrun_of(run_dir / "train_config.json")
    assert agent is not None, "the torchrun agent of this run"
    task = _ppid(agent)
    worker = _ppid(task)  # the executor's worker process that supervises the task
    for pid in (worker, task):
        os.kill(pid, signal.SIGKILL)
    # The agent learns it lost its parent (PR_SET_PDEATHSIG) and stops its ranks: no orphaned group.
    _wait(lambda: not _alive(agent), 120, "the agent gone")
    _check_recovered(af, run_id, run_dir, committed, tries=2)


def test_a_restarted_scheduler_lets_the_run_complete(live_airflow, dataset, tmp_root):
    af = live_airflow
    run_id, run_dir, committed = _start(af, dataset, tmp_root, "live-scheduler-restart")
    af.restart("scheduler")
    _check_recovered(af, run_id, run_dir, committed)


SWEEP = "training_sweep"


def _trials(url: str, study: str) -> list:
    import optuna

    return optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)


@pytest.mark.budget(420, reason="a three-trial sweep: its lane's worker killed, then its scheduler restarted")
def test_a_sweep_survives_a_scheduler_restart_and_a_killed_trial_without_training_a_finished_one_again(
        live_airflow, dataset, tmp_root):
    """The lane's worker is killed in a trial after its checkpoint, with an earlier trial finished,
    and the scheduler is restarted before it notices: the new scheduler retries the lost lane, whose
    retry resumes that trial from its checkpoint as the same Optuna trial and MLflow child run and
    never trains the finished one again; the sweep ends with every grid point once.

    (A scheduler stopped while a task runs waits for the task to end, LocalExecutor's graceful
    shutdown; a task killed as its process starts has no handler yet: those are Airflow's.)"""
    from optuna.trial import TrialState

    from training_airflow import settings

    af = live_airflow
    af.wait_for_dags(SWEEP)
    af.unpause(SWEEP)
    # 4000 steps of the small MLP: several seconds of training after each checkpoint, for the kill.
    experiment, steps, every = "live-sweep-faults", 4000, 500
    conf = {"dataset_uri": str(dataset), "experiment": experiment, "world_size": 1, "steps": steps,
            "eval_every": 2000, "log_every": every, "checkpoint_every": every, "batch_size": 32,
            "store_uri": (tmp_root / f"{experiment}-store").as_uri(), "search_space": {"lr": [3e-2, 1e-2, 3e-3]},
            "sampler": "grid", "pruner": "none", "trials": 3, "max_parallel_trials": 1, "objective": "eval/loss"}
    run_id = af.trigger(SWEEP, conf)
    _wait(lambda: af.task_states(SWEEP, run_id).get("open_sweep") == "success", 300, "open_sweep success")
    study, url = af.xcom(SWEEP, run_id, "open_sweep")["study"], settings.sweep_storage_url()
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    children = lambda: client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{study}'")  # noqa: E731
    # The lane creates the study's tables, then asks its first trial and opens that trial's child run:
    # the study is read only after that, never racing the lane's creation of its tables.
    _wait(children, 600, "the first trial's child run")

    def checkpointed_after_a_finished_trial():
        """A running trial past its first checkpoint, with its torchrun agent, once one trial is done."""
        trials = _trials(url, study)
        if not any(t.state == TrialState.COMPLETE for t in trials):
            return None
        for t in trials:
            if t.state == TrialState.RUNNING and "mlflow_run_id" in t.user_attrs:
                child = t.user_attrs["mlflow_run_id"]
                if (read_pointer(run_location(conf["store_uri"], experiment, child)) or {}).get("step", 0) >= every:
                    agent = _torchrun_of(tmp_root / "var" / "work" / child / "train_config.json")
                    return (t, agent, [x for x in trials if x.state == TrialState.COMPLETE]) if agent else None
        return None

    killed, agent, finished = _wait(checkpointed_after_a_finished_trial, 600, "a later trial past its checkpoint")
    task = _ppid(agent)
    for pid in (_ppid(task), task):
        os.kill(pid, signal.SIGKILL)
    # Mid-sweep, with the lane's task lost, the scheduler is stopped and started again: the new one
    # finds the task without a heartbeat and retries it.
    assert af.run(SWEEP, run_id)["state"] == "running"
    af.restart("scheduler")

    run = af.wait_for_run(SWEEP, run_id, timeout=900)
    assert run["state"] == "success", af.task_states(SWEEP, run_id)
    assert af.try_numbers(SWEEP, run_id)["trials"] == 2
    log = af.task_log(SWEEP, run_id, "trials", try_number=2, map_index=0)
    assert f"trial {killed.number} resumed" in log and "resuming from" in log, log[-3000:]
    trials = {t.number: t for t in _trials(url, study)}
    assert len(trials) == 3 and {t.state for t in trials.values()} == {TrialState.COMPLETE}, trials
    assert sorted(t.params["lr"] for t in trials.values()) == [3e-3, 1e-2, 3e-2]  # every point once
    assert all(t.user_attrs["steps"] == steps for t in trials.values())
    # The finished trials were not touched again; the killed one went on as itself.
    assert all(trials[t.number].datetime_complete == t.datetime_complete for t in finished)
    assert trials[killed.number].user_attrs["mlflow_run_id"] == killed.user_attrs["mlflow_run_id"]
    ran = children()
    assert sorted(r.info.run_id for r in ran) == sorted(t.user_attrs["mlflow_run_id"] for t in trials.values())
    assert all(r.info.status == "FINISHED" for r in ran)
