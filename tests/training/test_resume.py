"""Survival and exactness, with real torchrun ranks over gloo on loopback.

A rank SIGKILLed between two checkpoints makes torchrun restart the group, which resumes from the
newest checkpoint that verifies; SIGTERM makes the ranks checkpoint and exit 75 so that a second
launch resumes. Either way the final model.safetensors is bit-identical to an uninterrupted run
with the same seed, and the per-step losses after the resume point are the same floats. The same
holds with ``checkpoint_dir=s3://...`` on moto's S3 server (real HTTP on 127.0.0.1): a retry on a
worker with an empty disk, corrupt or uncommitted checkpoints, a store that dies mid-save, and a
bucket that is missing or forbidden.
"""

import hashlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import run_torchrun
from training.data.dataset import open_dataset
from training.train import StepLog

STEPS, EVERY = 30, 10


def _sets(dataset, root: Path, strategy: str, prec: str, steps: int = STEPS, **extra):
    base = {"dataset_uri": dataset, "checkpoint_dir": root / "ck", "output_dir": root / "out", "steps": steps,
            "checkpoint_every": EVERY, "batch_size": 32, "log_every": 5, "strategy": strategy, "precision": prec,
            "warmup_steps": 5, **extra}
    return [f"{k}={v}" for k, v in base.items()]


def _final_model(root: Path, step: int = STEPS) -> Path:
    return root / "ck" / f"step_{step:08d}" / "model.safetensors"


def _losses(root: Path) -> dict[int, str]:
    """step -> exact loss (float.hex) as rank 0 recorded it; a replayed step keeps its last value."""
    out = {}
    for line in (root / "out" / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def baselines(dataset, tmp_path_factory):
    """Uninterrupted runs, one per strategy/precision, shared by the tests below."""
    runs = {}
    for strategy, prec in (("ddp", "fp32"), ("ddp", "bf16"), ("fsdp", "fp32")):
        root = tmp_path_factory.mktemp(f"base-{strategy}-{prec}")
        runs[(strategy, prec)] = (root, _ok(run_torchrun(2, _sets(dataset, root, strategy, prec))))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("strategy, prec", [("ddp", "fp32"), ("ddp", "bf16"), ("fsdp", "fp32")])
def test_sigkill_between_checkpoints_resumes_bit_identical(dataset, tmp_path, baselines, strategy, prec):
    base_root, _ = baselines[(strategy, prec)]
    proc = _ok(run_torchrun(2, _sets(dataset, tmp_path, strategy, prec), max_restarts=1,
                            env={"TRAINING_FAULT_KILL_AT_STEP": "15:1"}))
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout
    assert "resuming from" in proc.stdout and "(step 10)" in proc.stdout, "the group must restart from step 10"
    assert "other settings" not in proc.stdout  # the restarted group's own checkpoint: nothing changed
    assert _sha(_final_model(tmp_path)) == _sha(_final_model(base_root))
    # Every step after the resume point (11..30, steps 11..15 replayed) matches exactly.
    got, want = _losses(tmp_path), _losses(base_root)
    assert [got[s] for s in range(11, STEPS + 1)] == [want[s] for s in range(11, STEPS + 1)]
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["restarts"] == 1


@pytest.mark.slow
def test_a_resume_under_other_settings_trains_on_and_names_each_field_that_changed(dataset, tmp_path, baselines):
    """A finished 30-step run's checkpoints, trained on to step 40 with another learning rate: the
    run resumes from step 30 with its own settings, and its log and MLflow run name each field that
    differs from those the checkpoint was saved under."""
    from training.config.train_config import TrainConfig
    from training.tracking.run import open_run

    base_root, _ = baselines[("ddp", "fp32")]
    shutil.copytree(base_root / "ck", tmp_path / "ck")
    lr = TrainConfig.__dataclass_fields__["lr"].default
    run_id = open_run("settings-changed", dag_id="distributed_training", dag_run_id="manual__settings_changed")
    proc = _ok(run_torchrun(2, _sets(dataset, tmp_path, "ddp", "fp32", steps=40, lr=lr / 2),
                            env={"MLFLOW_RUN_ID": run_id}))
    assert "resuming from" in proc.stdout and "(step 30)" in proc.stdout, proc.stdout[-3000:]
    changed = f"lr {lr!r} -> {lr / 2!r}, steps {STEPS} -> 40"
    assert f"with other settings than it was saved under: {changed};" in proc.stdout, proc.stdout[-3000:]
    assert MlflowClient().get_run(run_id).data.tags["checkpoint.settings_changed"] == changed
    assert _final_model(tmp_path, 40).is_file()


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_a_retry_resumes_bit_identical(dataset, tmp_path, baselines):
    base_root, _ = baselines[("ddp", "fp32")]
    sets = _sets(dataset, tmp_path, "ddp", "fp32", steps=STEPS)
    # Each step takes >= 0.1 s (a delayed all-reduce, which changes no number), so once step 12 is
    # recorded the ranks are more than a second from the end: the SIGTERM lands mid-run even when
    # this process is slow to see step 12 on a busy machine. Without it the 30 steps take ~0.2 s.
    proc = run_torchrun(2, sets, popen=True, env={"TRAINING_FAULT_COMM_DELAY_MS": "100"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if StepLog.last(tmp_path / "out") and StepLog.last(tmp_path / "out")["step"] >= 12:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what a preempting scheduler does to the launcher
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "preempted; checkpoint written at step" in out, out[-3000:]
    stopped_at = json.loads((tmp_path / "ck" / "latest").read_text())["step"]
    assert 12 <= stopped_at < STEPS

    again = _ok(run_torchrun(2, sets))
    assert f"(step {stopped_at})" in again.stdout
    assert _sha(_final_model(tmp_path)) == _sha(_final_model(base_root))
    got, want = _losses(tmp_path), _losses(base_root)
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]


@pytest.mark.slow
def test_fsdp_holds_about_half_the_state_of_ddp(baselines):
    """Exact byte counts of parameters + AdamW state (exp_avg, exp_avg_sq, step) per rank."""
    def reported(proc):
        line = next(l for l in proc.stdout.splitlines() if l.startswith("memory: "))
        return int(line.split()[1])

    ddp, fsdp = reported(baselines[("ddp", "fp32")][1]), reported(baselines[("fsdp", "fp32")][1])
    weights = load_file(str(_final_model(baselines[("ddp", "fp32")][0])))
    n_params, n_tensors = sum(t.numel() for t in weights.values()), len(weights)
    # fp32 params + two fp32 moments = 12 bytes/param; one fp32 `step` scalar per tensor.
    assert ddp == 12 * n_params + 4 * n_tensors
    # Every MLP dimension sharded (dim 0) is even, so each of 2 ranks holds exactly half.
    assert fsdp == 12 * n_params // 2 + 4 * n_tensors
    assert fsdp <= 0.55 * ddp


@pytest.mark.slow
def test_fsdp_two_rank_checkpoint_resumes_on_one_rank(dataset, tmp_path, baselines):
    base_root, _ = baselines[("fsdp", "fp32")]
    # Continue the 2-rank run's step-30 checkpoint on 1 rank up to step 60.
    shutil.copytree(base_root / "ck", tmp_path / "ck")
    proc = _ok(run_torchrun(1, _sets(dataset, tmp_path, "fsdp", "fp32", steps=60)))
    assert "on 1 ranks" in proc.stdout and "(step 30)" in proc.stdout
    losses = {k: float.fromhex(v) for k, v in _losses(tmp_path).items()}
    assert min(losses) == 31, "training continued from step 30"
    first, last = sum(losses[s] for s in range(31, 36)) / 5, sum(losses[s] for s in range(56, 61)) / 5
    assert last < first, (first, last)
    assert _final_model(tmp_path, 60).exists()


@pytest.mark.slow
def test_fp16_inf_gradient_skips_the_step_and_backs_off_the_scale(dataset, tmp_path):
    proc = _ok(run_torchrun(2, _sets(dataset, tmp_path, "ddp", "fp16", steps=60, comm_hook="fp16", checkpoint_every=0,
                                     log_every=10), env={"TRAINING_FAULT_INF_GRAD_AT_STEP": "5"}))
    records = [json.loads(l) for l in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["skipped"]] == [5]
    assert "scale 32768 skipped 1" in proc.stdout  # 2**16 halved once
    losses = [float.fromhex(r["loss"]) for r in records]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10, "training still converges"


@pytest.fixture(scope="module")
def user_table(dataset, tmp_path_factory):
    """The teacher data as a user would have it: the two Parquet folders, no dataset.json (the
    schema, the task and the normalization statistics are inferred from train)."""
    import shutil

    root = tmp_path_factory.mktemp("user-table")
    for split in ("train", "validation"):
        shutil.copytree(Path(dataset) / split, root / split)
    return root


FACTORY = ["model=resmlp:residual_mlp", 'model_args={"width": 32, "blocks": 2, "dropout": 0.1}']
EXAMPLES = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "examples")}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_resume_is_bit_identical_with_a_user_factory(user_table, tmp_path, strategy):
    """The user's residual MLP (examples/resmlp.py, on PYTHONPATH) with dropout, on a table without
    metadata (features standardized inside the model): the resumed run ends bit-identical."""
    base, killed = tmp_path / "base", tmp_path / "killed"
    _ok(run_torchrun(2, _sets(user_table, base, strategy, "fp32") + FACTORY, env=EXAMPLES))
    proc = _ok(run_torchrun(2, _sets(user_table, killed, strategy, "fp32") + FACTORY, max_restarts=1,
                            env={**EXAMPLES, "TRAINING_FAULT_KILL_AT_STEP": "15:1"}))
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout and "(step 10)" in proc.stdout
    assert _sha(_final_model(killed)) == _sha(_final_model(base))
    got, want = _losses(killed), _losses(base)
    assert [got[s] for s in range(11, STEPS + 1)] == [want[s] for s in range(11, STEPS + 1)]
    config = json.loads((_final_model(killed).parent / "model_config.json").read_text())
    assert config["model"] == "resmlp:residual_mlp" and len(config["normalization"]["mean"]) == 16


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_bf16_hook_on_cpu_is_refused_before_any_process_group(dataset, tmp_path):
    proc = run_torchrun(2, _sets(dataset, tmp_path, "ddp", "fp32", comm_hook="bf16"))
    assert proc.returncode != 0
    assert "config field 'comm_hook': bf16 gradient compression needs CUDA" in proc.stderr + proc.stdout
    assert "train: " not in proc.stdout  # nothing started
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_model_and_dataset_kind_must_match(dataset, tmp_path):
    proc = run_torchrun(1, _sets(dataset, tmp_path, "ddp", "fp32", model="transformer"))
    assert proc.returncode != 0
    assert "config field 'model': transformer reads tokens data" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_a_hung_rank_times_out_and_the_error_names_rank_and_operation(dataset, tmp_path):
    proc = run_torchrun(2, _sets(dataset, tmp_path, "ddp", "fp32", collective_timeout_s=5, preempt_grace_s=2),
                        env={"TRAINING_FAULT_HANG_AT_STEP": "3:1"}, timeout=180)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rank 1 hangs after step 3" in out
    # Rank 0 waits in step 4's gradient all-reduce (inside backward) until the 5 s collective timeout.
    # gloo words the timeout two ways ("Timed out waiting 5000ms for recv", "Application timeout
    # caused pair closure"); the trainer names it one way, with the knob to look at.
    assert ("RuntimeError: rank 0/2: forward/backward failed at step 3: a collective timed out after "
            "collective_timeout_s=5s (another rank stopped responding") in out, out[-4000:]
    # What the launcher reads afterwards: both ranks completed step 3; rank 0 recorded where it
    # failed, the hung rank recorded nothing (it was killed in its hang).
    from training.distributed.resilience import RankRecord

    ranks = RankRecord.read(tmp_path / "out")
    assert [(r["rank"], r["last_step"]) for r in ranks] == [(0, 3), (1, 3)]
    assert ranks[1]["failure"] is None
    assert (ranks[0]["failure"]["phase"], ranks[0]["failure"]["step"]) == ("forward/backward", 3)
    assert ranks[0]["failure"]["error"].startswith("a collective timed out after collective_timeout_s=5s: RuntimeError:")


# --------------------------------------------------------------------------- checkpoints in the store
# The same survival, with checkpoint_dir=s3://... on moto's S3 server over HTTP on 127.0.0.1: every
# rank writes its own files straight to the bucket, rank 0 commits the manifest and `latest`, and
# resume reads back only what verifies.

BUCKET = "ckpt"


def _s3(s3_server):
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket=BUCKET)
    return s3


def _store_sets(dataset, root: Path, prefix: str, strategy: str = "ddp", prec: str = "fp32", **extra):
    return _sets(dataset, root, strategy, prec, checkpoint_dir=f"s3://{BUCKET}/{prefix}", **extra)


def _stored_sha(s3, prefix: str, step: int = STEPS, name: str = "model.safetensors") -> str:
    return hashlib.sha256(s3.get_object(Bucket=BUCKET, Key=f"{prefix}/step_{step:08d}/{name}")["Body"].read()).hexdigest()


def _latest(s3, prefix: str) -> dict:
    return json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}/latest")["Body"].read())


def _keys(s3, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/")
    return {o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkill_with_checkpoints_in_s3_resumes_from_the_store_bit_identical(dataset, tmp_path, baselines, s3_server,
                                                                            strategy):
    s3 = _s3(s3_server)
    proc = _ok(run_torchrun(2, _store_sets(dataset, tmp_path, "k", strategy), max_restarts=1,
                            env={"TRAINING_FAULT_KILL_AT_STEP": "15:1"}))
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout
    assert f"resuming from s3://{BUCKET}/k/step_00000010 (step 10)" in proc.stdout
    assert not (tmp_path / "ck").exists(), "nothing was written to a local checkpoint folder"
    base_root, _ = baselines[(strategy, "fp32")]
    assert _stored_sha(s3, "k") == _sha(_final_model(base_root))
    assert _latest(s3, "k")["step_dir"] == f"step_{STEPS:08d}"
    # Each commit names every file with the sha256 its writer computed; retention kept the last 3.
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key="k/step_00000020/manifest.json")["Body"].read())
    assert {f["path"] for f in manifest["files"]} == {".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt",
                                                      "rng_rank1.pt"}
    for f in manifest["files"]:
        assert _stored_sha(s3, "k", 20, f["path"]) == f["sha256"]
    assert {k.split("/")[0] for k in _keys(s3, "k")} == {"latest", ".write-check", "step_00000010", "step_00000020",
                                                        "step_00000030"}


@pytest.mark.slow
def test_a_retry_on_a_worker_with_an_empty_disk_resumes_from_the_store(dataset, baselines, s3_server, monkeypatch,
                                                                        caplog, capfd):
    """The local backend's `train` task body, twice: the first try loses a rank after step 25 (no
    torchrun restarts), then the worker's whole work folder is deleted, as a new machine would
    have it; the retry resumes from the store at step 20, the last committed step, not from 0."""
    from training.tracking.run import open_run
    from training_airflow import settings
    from training_airflow.backends import local

    s3 = _s3(s3_server)
    run_id = open_run("store-retry", dag_id="distributed_training", dag_run_id="manual__retry")
    params = {"world_size": 2, "max_restarts": 0, "store_uri": f"s3://{BUCKET}/team", "experiment": "store-retry",
              "checkpoint_location": "store", "aws_conn_id": None, "steps": STEPS, "checkpoint_every": EVERY,
              "batch_size": 32, "log_every": 5, "warmup_steps": 5, "eval_every": 0, "dataset_uri": str(dataset)}
    opened = {"mlflow_run_id": run_id, "dataset_uri": str(dataset), "dataset_fingerprint": open_dataset(dataset).fingerprint}
    prefix = f"team/store-retry/{run_id}"

    monkeypatch.setenv("TRAINING_FAULT_KILL_AT_STEP", "25:1")
    with pytest.raises(local.TrainingFailed):
        local.run_torchrun(params, opened)
    assert _latest(s3, prefix)["step_dir"] == "step_00000020"
    assert settings.work_dir(run_id).exists()
    shutil.rmtree(settings.work_dir(run_id))  # a new machine: no work folder, no steps.jsonl, nothing

    monkeypatch.delenv("TRAINING_FAULT_KILL_AT_STEP")
    caplog.set_level("INFO", logger="training_airflow.backends.local")
    capfd.readouterr()
    trained = local.run_torchrun(params, opened)
    # The task log: a log record, or printed when Airflow's structlog set-up already ran in this process.
    printed = capfd.readouterr()
    assert f"resuming from s3://{BUCKET}/{prefix}/step_00000020 (step 20)" in caplog.text + printed.out + printed.err
    handoff = local.commit(params, trained)
    assert handoff["checkpoint_uri"] == f"s3://{BUCKET}/{prefix}/step_{STEPS:08d}"
    assert _stored_sha(s3, prefix) == _sha(_final_model(baselines[("ddp", "fp32")][0]))
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["checkpoint.resumed_from"] == f"s3://{BUCKET}/{prefix}/step_00000020"
    assert tags["checkpoint.uri"] == handoff["checkpoint_uri"]


@pytest.mark.slow
def test_checkpoint_location_local_keeps_them_on_the_worker_and_uploads_the_final_one(dataset, tmp_path):
    """The other choice of the Param: periodic checkpoints in the work folder (with their
    manifests), and `upload_checkpoint` commits the final one to the store after training."""
    from training.tracking.run import open_run
    from training_airflow import settings
    from training_airflow.backends import local

    store = tmp_path / "store"
    run_id = open_run("local-ckpt", dag_id="distributed_training", dag_run_id="manual__local")
    params = {"world_size": 2, "max_restarts": 0, "store_uri": store.as_uri(), "experiment": "local-ckpt",
              "checkpoint_location": "local", "aws_conn_id": None, "steps": 20, "checkpoint_every": EVERY,
              "batch_size": 32, "log_every": 5, "eval_every": 0, "dataset_uri": str(dataset)}
    opened = {"mlflow_run_id": run_id, "dataset_uri": str(dataset), "dataset_fingerprint": open_dataset(dataset).fingerprint}
    trained = local.run_torchrun(params, opened)
    worker = settings.work_dir(run_id) / "checkpoints"
    assert trained["checkpoint_uri"] == (worker / "step_00000020").resolve().as_uri()
    assert all((worker / d / "manifest.json").is_file() for d in ("step_00000010", "step_00000020"))
    handoff = local.commit(params, trained)
    committed = store / "local-ckpt" / run_id
    assert handoff["checkpoint_uri"] == (committed / "step_00000020").resolve().as_uri()
    assert sorted(p.name for p in committed.iterdir()) == ["latest", "step_00000020"]
    assert (committed / "step_00000020" / "model.safetensors").read_bytes() == (
        worker / "step_00000020" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_corrupt_shard_and_missing_manifest_fall_back_to_the_newest_that_verifies(dataset, tmp_path, s3_server):
    """Checkpoints every 5 steps; a first attempt dies after step 27 (25 committed). Then a shard
    of step 25 is altered and step 20 loses its manifest: the next attempt resumes from 15, says
    why in its log and MLflow run, and ends exactly where a resume from step 15 by hand ends."""
    from training.checkpoint.commit import Location, candidates, commit, verified_file
    from training.store import open_store
    from training.tracking.run import open_run

    s3 = _s3(s3_server)
    sets = _store_sets(dataset, tmp_path, "fb", checkpoint_every=5, retention_keep_last=0, eval_every=5)
    proc = run_torchrun(2, sets, env={"TRAINING_FAULT_KILL_AT_STEP": "27:1"})
    assert proc.returncode != 0 and _latest(s3, "fb")["step_dir"] == "step_00000025"

    # The same step-15 checkpoint alone in another place, committed as the only one: "by hand".
    for key in _keys(s3, "fb"):
        if key.startswith("step_00000015/"):
            s3.copy_object(Bucket=BUCKET, Key=f"hand/{key}", CopySource={"Bucket": BUCKET, "Key": f"fb/{key}"})
    raw = s3.get_object(Bucket=BUCKET, Key="hand/step_00000015/manifest.json")["Body"].read()
    commit(Location(open_store(f"s3://{BUCKET}/hand")), "step_00000015", raw, step=15, write_manifest=False)

    key = "fb/step_00000025/__1_0.distcp"
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    s3.delete_object(Bucket=BUCKET, Key="fb/step_00000020/manifest.json")

    run_id = open_run("store-fallback", dag_id="distributed_training", dag_run_id="manual__fallback")
    again = _ok(run_torchrun(2, sets, env={"MLFLOW_RUN_ID": run_id}))
    reasons = ["step_00000025/__1_0.distcp does not match its manifest sha256",
               "step_00000020: no manifest (incomplete upload), ignored"]
    for reason in reasons:
        assert f"checkpoint fallback: {reason}" in again.stdout, again.stdout[-3000:]
    assert f"resuming from s3://{BUCKET}/fb/step_00000015 (step 15)" in again.stdout
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["checkpoint.resumed_from"] == f"s3://{BUCKET}/fb/step_00000015"
    assert all(reason in tags["checkpoint.fallback_reason"] for reason in reasons), tags["checkpoint.fallback_reason"]

    by_hand = _ok(run_torchrun(2, _store_sets(dataset, tmp_path / "hand", "hand", checkpoint_every=5)))
    assert f"resuming from s3://{BUCKET}/hand/step_00000015 (step 15)" in by_hand.stdout
    assert "checkpoint fallback" not in by_hand.stdout
    assert _stored_sha(s3, "fb") == _stored_sha(s3, "hand")
    # The re-saved steps 20 and 25 replaced the rejected ones and `latest` moved past them; each
    # checkpoint evaluated during training carries its eval.json (retention's best-by-eval rule).
    assert _latest(s3, "fb")["step_dir"] == f"step_{STEPS:08d}"
    assert {k for k in _keys(s3, "fb") if k.endswith("/eval.json")} == {
        f"step_{s:08d}/eval.json" for s in range(5, STEPS + 1, 5)}
    loc = Location(open_store(f"s3://{BUCKET}/fb"))
    for step_dir in ("step_00000020", "step_00000025"):
        (cand,) = candidates(loc, step_dir)
        for f in cand.manifest["files"]:
            verified_file(loc, step_dir, f, tmp_path / "dl")  # raises if any object differs


class DyingProxy:
    """A TCP proxy on 127.0.0.1 in front of moto that dies (stops listening, drops every
    connection) as soon as a request containing ``die_on`` passes through: for the ranks the S3
    endpoint is gone in the middle of a save, while moto behind it keeps what was stored for the
    test to inspect (moto itself keeps nothing across a restart)."""

    def __init__(self, target_port: int, *, die_on: bytes | None = None, port: int = 0):
        self.target_port, self.die_on = target_port, die_on
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", port))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.dead = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.dead.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if inspect and self.die_on is not None and self.die_on in data:
                    self.die()
                    return
                dst.sendall(data)
        except OSError:
            pass

    def die(self) -> None:
        self.dead.set()
        for s in [self.server, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_store_dies_during_a_periodic_save_fails_the_run_and_keeps_what_was_committed(
        dataset, tmp_path, baselines, s3_server, mode):
    """Training fails (the choice: after botocore's retries the store is down, not blipping, and
    the retry path resumes from the last commit; see docs/architecture.md). `latest` stays on step
    10, which still verifies; step 20 has no manifest; a retry once the store is back resumes from
    10 and ends bit-identical to an uninterrupted run."""
    from training.checkpoint.commit import fetch_checkpoint

    s3 = _s3(s3_server)
    moto_port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    proxy = DyingProxy(moto_port, die_on=b"/step_00000020/")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "AWS_MAX_ATTEMPTS": "2",
           "TRAINING_S3_CONNECT_TIMEOUT_S": "2", "TRAINING_S3_READ_TIMEOUT_S": "2"}
    sets = _store_sets(dataset, tmp_path, "team/e/r", async_checkpoint=str(mode == "async").lower())
    proc = run_torchrun(2, sets, env=env)
    assert proxy.dead.is_set(), "the endpoint died during the step-20 save"
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"checkpoint s3://{BUCKET}/team/e/r/step_00000020 was not committed" in out, out[-4000:]
    assert re.search(r"(S3 endpoint unreachable|connection to s3://ckpt at \S+ lost) after 2 attempts", out)

    assert _latest(s3, "team/e/r")["step_dir"] == "step_00000010"
    assert "step_00000020/manifest.json" not in _keys(s3, "team/e/r")
    local, manifest, warnings = fetch_checkpoint(f"s3://{BUCKET}/team", experiment="e", run_id="r", dest=tmp_path / "dl")
    assert (local.name, manifest["step"], warnings) == ("step_00000010", 10, [])

    DyingProxy(moto_port, port=proxy.port)  # the endpoint is back, at the same address
    again = _ok(run_torchrun(2, sets, env=env))
    assert f"resuming from s3://{BUCKET}/team/e/r/step_00000010 (step 10)" in again.stdout
    assert _stored_sha(s3, "team/e/r") == _sha(_final_model(baselines[("ddp", "fp32")][0]))


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_a_missing_or_forbidden_bucket_is_refused_before_any_rank_starts(dataset, tmp_path, s3_server, monkeypatch):
    _s3(s3_server)
    sets = [s.replace(f"s3://{BUCKET}/", "s3://nope/") for s in _store_sets(dataset, tmp_path, "x/r")]
    missing = subprocess.run([sys.executable, "-m", "training", "train", *[a for s in sets for a in ("--set", s)]],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert ("config field 'checkpoint_dir': bucket 'nope' does not exist (list x/r/); create it or fix "
            "checkpoint_dir") in missing.stderr, missing.stderr

    # moto enforces IAM once INITIAL_NO_AUTH_ACTION_COUNT requests are used up: with 0 our key is
    # refused like a revoked one. Under torchrun every rank refuses before the process group.
    from tests.training.test_storage_faults import Moto

    server = Moto(tmp_path, env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        secret = "never-print-this-secret"
        denied = run_torchrun(2, _store_sets(dataset, tmp_path, "x/r"),
                              env={"AWS_ENDPOINT_URL": server.endpoint, "AWS_SECRET_ACCESS_KEY": secret})
    finally:
        server.stop()
    out = denied.stdout + denied.stderr
    assert denied.returncode != 0 and "exitcode  : 2" in out
    assert (f"config field 'checkpoint_dir': access denied to s3://{BUCKET} at {server.endpoint} (list x/r/: "
            "InvalidAccessKeyId)") in out, out[-3000:]
    assert secret not in out and "train: " not in out
    assert not (tmp_path / "out").exists(), "no rank started training"
