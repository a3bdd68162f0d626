"""Every figure the trainer logs, checked against a ground truth measured outside the trainer.

Real torchrun ranks over gloo on loopback and a real MLflow store (the session's SQLite file):
- injected delay: each gradient all-reduce completes d ms later (TRAINING_FAULT_COMM_DELAY_MS, a
  test-only fault); comm/s_per_step rises by d x collectives per step, and exposed time rises;
- bytes: comm/bytes_per_step is the gradient bytes of the saved model exactly, half with fp16;
- FSDP2: all-gathers and reduce-scatters are counted (3 per unit per step), their bytes exact,
  all of their time exposed on gloo, and an injected delay per collective shows up in full;
- throughput: reported samples/s against rank 0's own step-end stamps, and against the wall time
  between progress lines as this process read them;
- MFU: the logged value is FLOPs per sample (6 x parameters of the saved MLP) x samples/s / peak;
- evaluation: eval/accuracy at the last step equals an independent scoring of the final model;
- no double counting: a rank killed (group restart) and a failed launch run again (task retry)
  replay steps, yet every metric has exactly one value per step.
Tolerances are loose (a shared 2-core machine) and no absolute speed is asserted.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import run_torchrun
from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.metrics.formulas import lineage_summary
from training.metrics.peak import _table_peak, peak_flops
from training.metrics.steps import StepLog
from training.tracking.run import get_or_create_experiment, read_summary

PROGRESS = re.compile(r"^step (\d+)/\d+ \| loss [0-9.]+ \| (\d+) samples/s")
BATCH = 64
BASE_STEPS = 400


def _sets(dataset, root: Path, **extra) -> list[str]:
    base = {"dataset_uri": dataset, "checkpoint_dir": root / "ck", "output_dir": root / "out", "steps": 60,
            "batch_size": BATCH, "log_every": 10, "checkpoint_every": 0, "warmup_steps": 5, **extra}
    return [f"{k}={v}" for k, v in base.items()]


def _new_run(name: str) -> str:
    client = MlflowClient()
    # The project's own experiment set-up: artifacts next to the test store, not in the working folder.
    return client.create_run(get_or_create_experiment("test-metrics"), run_name=name).info.run_id


def _timed_run(dataset, root: Path, *, env: dict[str, str] | None = None, **extra) -> dict:
    """One torchrun launch; every stdout line with the time this process read it."""
    run_id = _new_run(root.name)
    launched = time.monotonic()
    proc = run_torchrun(2, _sets(dataset, root, **extra), env={"MLFLOW_RUN_ID": run_id, **(env or {})}, popen=True)
    lines = []
    deadline = time.monotonic() + 400
    for line in proc.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
        assert time.monotonic() < deadline, "training took too long"
    proc.wait(timeout=60)
    out = "\n".join(text for _, text in lines)
    assert proc.returncode == 0, out[-4000:]
    return {"run_id": run_id, "lines": lines, "stdout": out, "root": root, "launched": launched}


def _history(run_id: str, key: str) -> list:
    return sorted(MlflowClient().get_metric_history(run_id, key), key=lambda m: m.step)


def _median_after_first(run_id: str, key: str) -> float:
    values = [m.value for m in _history(run_id, key)]  # the first, warm-up interval is not in the series
    assert values, key
    return statistics.median(values)


def _grad_numel(root: Path) -> int:
    final = max((root / "ck").glob("step_*"))
    weights = load_file(str(final / "model.safetensors"))
    return sum(t.numel() for t in weights.values())


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """The same 2-rank DDP MLP run three ways: plain, every all-reduce delayed, fp16 compression.

    The delay is large against what a busy 2-core machine adds to a step by itself (a few ms of
    waiting for a CPU after the all-reduce completes): the signal dwarfs the noise, so the ±15%
    bounds hold while another job loads the machine (tests/load.py)."""
    delay_ms = 200
    return {
        # Long enough (about 1.5 s between the second and the last progress line on two quiet
        # cores, more under load) that one window's jitter stays well inside the 5% tolerance.
        "base": _timed_run(dataset, tmp_path_factory.mktemp("base"), steps=BASE_STEPS),
        "delay": _timed_run(dataset, tmp_path_factory.mktemp("delay"), env={"TRAINING_FAULT_COMM_DELAY_MS": str(delay_ms)}),
        "fp16": _timed_run(dataset, tmp_path_factory.mktemp("fp16"), comm_hook="fp16"),
        "delay_s": delay_ms / 1000,
    }


@pytest.fixture(scope="module")
def bucket_runs(dataset, tmp_path_factory):
    """A model of several DDP buckets (hidden 512 x 5 is 4.2 MB of gradients; 0.5 MB buckets: each
    512 x 512 weight alone, the small ones together), plain and with every collective 100 ms later."""
    delay_ms, sets = 100, {"hidden": 512, "depth": 5, "bucket_cap_mb": 0.5, "steps": 20, "log_every": 5}
    return {
        "base": _timed_run(dataset, tmp_path_factory.mktemp("buckets"), **sets),
        "delay": _timed_run(dataset, tmp_path_factory.mktemp("buckets-delay"),
                            env={"TRAINING_FAULT_COMM_DELAY_MS": str(delay_ms)}, **sets),
        "delay_s": delay_ms / 1000,
    }


def _delay_ground_truth(base: str, slow: str, d: float, *, min_collectives: int) -> None:
    """Every collective of the delayed run completes ``d`` later: its time in flight per step
    rises by d x collectives (±15%); the last bucket's delay, which no compute can hide, is
    exposed (at least 0.85 d, at most all of it)."""
    collectives = _median_after_first(slow, "comm/collectives_per_step")
    assert collectives == _median_after_first(base, "comm/collectives_per_step") >= min_collectives
    rise = _median_after_first(slow, "comm/s_per_step") - _median_after_first(base, "comm/s_per_step")
    assert rise == pytest.approx(d * collectives, rel=0.15), (rise, d, collectives)
    exposed_rise = _median_after_first(slow, "comm/exposed_s_per_step") - _median_after_first(base, "comm/exposed_s_per_step")
    assert 0.85 * d <= exposed_rise <= 1.15 * d * collectives, exposed_rise


@pytest.mark.slow
def test_injected_delay_shows_up_in_comm_time_and_exposed_time(runs):
    base, slow = runs["base"]["run_id"], runs["delay"]["run_id"]
    _delay_ground_truth(base, slow, runs["delay_s"], min_collectives=1)
    assert _median_after_first(slow, "comm/exposed_fraction") > _median_after_first(base, "comm/exposed_fraction") + 0.1
    assert "% exposed" in runs["delay"]["stdout"]


@pytest.mark.slow
def test_per_bucket_timing_counts_every_collective_of_a_step(bucket_runs):
    """Several buckets per step: the delay shows up once per collective in the time in flight; the
    last bucket's delay (at least) is exposed; undelayed, backward hides part of the all-reduces."""
    base, slow = bucket_runs["base"]["run_id"], bucket_runs["delay"]["run_id"]
    _delay_ground_truth(base, slow, bucket_runs["delay_s"], min_collectives=4)


@pytest.mark.slow
def test_bytes_per_step_are_the_gradient_bytes_exactly(runs):
    numel = _grad_numel(runs["base"]["root"])
    assert {m.value for m in _history(runs["base"]["run_id"], "comm/bytes_per_step")} == {4.0 * numel}
    assert {m.value for m in _history(runs["fp16"]["run_id"], "comm/bytes_per_step")} == {2.0 * numel}
    # Bus bandwidth follows from the same bytes and time: 2(n-1)/n x bytes / time with n = 2.
    for bw, comm in zip(_history(runs["base"]["run_id"], "comm/busbw_gbps"), _history(runs["base"]["run_id"], "comm/s_per_step")):
        assert bw.value == pytest.approx(4.0 * numel / comm.value / 1e9, rel=1e-6)


@pytest.mark.slow
def test_reported_throughput_matches_wall_clock_between_progress_lines(runs):
    """Two clocks outside the window arithmetic (perf_counter spans, the ranks' mean per window):
    rank 0's own stamp at the end of each step (steps.jsonl, time.time()), and the moment this
    process read each progress line. The first is exact to the step; the second is late by however
    long this process waited for a CPU (0.2 s seen on a loaded 2-core machine), so it gets that slack."""
    for name in ("base", "delay"):
        progress = [(t, int(m[1]), int(m[2])) for t, line in runs[name]["lines"] if (m := PROGRESS.match(line))]
        assert [p[1] for p in progress] == list(range(10, {"base": BASE_STEPS, "delay": 60}[name] + 1, 10))
        # A line is printed after its window closed and the metrics were logged. From the third
        # line on, that delay is the same at both ends: the first window logs no speed figures
        # (warm-up), so the second is the one that creates the speed and comm keys in the store
        # (0.3 s seen, 0.5 s under load, against a few ms for a later log of the same keys).
        progress = progress[2:]
        (t0, s0, _), (t1, s1, _) = progress[0], progress[-1]
        # The trainer's windows are contiguous: total samples over the sum of window times.
        window_s = sum((b[1] - a[1]) * BATCH / b[2] for a, b in zip(progress, progress[1:]))
        reported = (s1 - s0) * BATCH / window_s
        stamps = {r["step"]: r["t"] for r in StepLog.iter(runs[name]["root"] / "out")}
        stamped = (s1 - s0) * BATCH / (stamps[s1] - stamps[s0])
        assert reported == pytest.approx(stamped, rel=0.05), (name, reported, stamped)
        # Read late at either end: the span here is off by up to the read delay, never by more.
        assert window_s == pytest.approx(t1 - t0, rel=0.05, abs=0.3), (name, window_s, t1 - t0)


@pytest.mark.slow
def test_startup_phases_add_up_inside_the_launch_to_first_progress_line(runs):
    """startup/*: rank 0's phases from its process start to the first step sum to startup/total_s,
    which fits between torchrun's launch and the first progress line (read here, 10 steps later)."""
    run = runs["base"]
    metrics = MlflowClient().get_run(run["run_id"]).data.metrics
    phases = {k: v for k, v in metrics.items() if k.startswith("startup/") and k != "startup/total_s"}
    assert {"startup/imports_s", "startup/data_s", "startup/process_group_s", "startup/model_s",
            "startup/mlflow_s"} <= set(phases), sorted(phases)
    assert all(v >= 0 for v in phases.values()) and metrics["startup/imports_s"] > 0
    assert sum(phases.values()) == pytest.approx(metrics["startup/total_s"], abs=1e-6)
    first_line = next(t for t, text in run["lines"] if PROGRESS.match(text))
    assert 0 < metrics["startup/total_s"] < first_line - run["launched"]
    assert _history(run["run_id"], "startup/total_s")[0].step == 0
    assert f"startup: {metrics['startup/total_s']:.2f}s from process start to the first step" in run["stdout"]


@pytest.mark.slow
def test_mfu_is_model_flops_over_the_logged_peak(runs):
    run = MlflowClient().get_run(runs["base"]["run_id"])
    # The measured peak is a fact of the machine, not a choice: a tag.
    peak, per_sample = float(run.data.tags["perf/peak_flops"]), float(run.data.params["perf/flops_per_sample"])
    assert run.data.tags["perf/peak_source"].startswith("measured: cpu matmul")
    assert per_sample == 6.0 * _grad_numel(runs["base"]["root"])
    for mfu, thr in zip(_history(run.info.run_id, "perf/mfu"), _history(run.info.run_id, "perf/samples_per_s")):
        assert mfu.value == pytest.approx(per_sample * thr.value / (2 * peak), rel=1e-9)
        assert 0 < mfu.value < 1


@pytest.fixture(scope="module")
def fsdp_runs(dataset, tmp_path_factory):
    """The same MLP under FSDP2: plain, and every all-gather / reduce-scatter delayed."""
    delay_ms = 40  # x 9 collectives: 0.36 s per step, far above a busy machine's scheduling noise
    return {
        "base": _timed_run(dataset, tmp_path_factory.mktemp("fsdp-base"), strategy="fsdp", eval_every=30),
        "delay": _timed_run(dataset, tmp_path_factory.mktemp("fsdp-delay"), strategy="fsdp", steps=30, log_every=5,
                            env={"TRAINING_FAULT_COMM_DELAY_MS": str(delay_ms)}),
        "delay_s": delay_ms / 1000,
    }


@pytest.mark.slow
def test_fsdp_collectives_are_counted_timed_and_exposed(fsdp_runs):
    """FSDP2 (reshard after forward, its default) all-gathers each unit's parameters in forward and
    again in backward, and reduce-scatters its gradients: 3 collectives per unit, 3x the parameter
    bytes per step. The MLP's three Linear layers are the units (the root holds no parameters)."""
    base, slow, d = fsdp_runs["base"]["run_id"], fsdp_runs["delay"]["run_id"], fsdp_runs["delay_s"]
    numel, units = _grad_numel(fsdp_runs["base"]["root"]), 3
    # Evaluation (every 30 steps in the base run) all-gathers too; it must not leak into step figures.
    assert {m.value for m in _history(base, "comm/collectives_per_step")} == {3.0 * units}
    assert {m.value for m in _history(base, "comm/bytes_per_step")} == {3 * 4.0 * numel}
    for bw, comm in zip(_history(base, "comm/busbw_gbps"), _history(base, "comm/s_per_step")):
        assert bw.value == pytest.approx(3 * 4.0 * numel * (2 - 1) / 2 / comm.value / 1e9, rel=1e-6)
    # On gloo FSDP2 waits for each collective in the training thread: all of it is exposed.
    for exposed, comm in zip(_history(base, "comm/exposed_s_per_step"), _history(base, "comm/s_per_step")):
        assert exposed.value == pytest.approx(comm.value, rel=0.01)
    rise = _median_after_first(slow, "comm/s_per_step") - _median_after_first(base, "comm/s_per_step")
    assert rise == pytest.approx(d * 3 * units, rel=0.15), (rise, d)
    exposed_rise = _median_after_first(slow, "comm/exposed_s_per_step") - _median_after_first(base, "comm/exposed_s_per_step")
    assert exposed_rise == pytest.approx(d * 3 * units, rel=0.15), exposed_rise
    assert _median_after_first(slow, "comm/exposed_fraction") > _median_after_first(base, "comm/exposed_fraction") + 0.1
    assert "% exposed" in fsdp_runs["base"]["stdout"]


@pytest.mark.slow
def test_each_step_logged_once_across_a_group_restart_and_a_task_retry(dataset, tmp_path):
    """Launch 1 dies at step 15 (a rank SIGKILLed, no restarts left): the task fails. The retry
    resumes from step 10; in it a rank dies at step 25 and torchrun restarts the group from 20."""
    run_id = _new_run("retried")
    sets = _sets(dataset, tmp_path, steps=40, log_every=5, checkpoint_every=10, eval_every=10,
                 target_metric="eval/accuracy", target_value=0.3)
    env = {"MLFLOW_RUN_ID": run_id, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}
    first = run_torchrun(2, sets, env={**env, "TRAINING_FAULT_KILL_AT_STEP": "15:1"})
    assert first.returncode != 0 and "SIGKILLs itself after step 15" in first.stdout
    retry = run_torchrun(2, sets, env={**env, "TRAINING_FAULT_KILL_AT_STEP": "25:1"}, max_restarts=1)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    assert "(step 10)" in retry.stdout and "(step 20)" in retry.stdout

    every5, every10 = list(range(5, 41, 5)), list(range(10, 41, 10))
    assert [m.step for m in _history(run_id, "train/loss")] == every5
    # Speed figures leave out the first window of each attempt (warm-up: steps 5, 15 and 25).
    for key in ("perf/samples_per_s", "comm/s_per_step", "comm/exposed_fraction", "perf/mfu"):
        assert [m.step for m in _history(run_id, key)] == [10, 20, 30, 35, 40], key
    for key in ("eval/loss", "eval/accuracy", "ckpt/blocking_s"):
        assert [m.step for m in _history(run_id, key)] == (every10 if key.startswith("eval") else [10, 20, 30]), key
    s = read_summary(run_id)  # one-off figures: the run summary, the headline ones also one-value metrics
    assert s["steps_to_target"] == 10.0 and s["time_to_target_s"] > 0
    # Each rank's peak memory every window (a torch process holds well over 100 MB), the max beside it.
    peaks = {k: [m.value for m in _history(run_id, f"mem/peak_bytes_{k}")] for k in ("rank_0", "rank_1", "max")}
    assert all(len(v) == len(every5) for v in peaks.values()), peaks
    assert peaks["max"] == [max(a, b) for a, b in zip(peaks["rank_0"], peaks["rank_1"])]
    assert min(peaks["rank_0"] + peaks["rank_1"]) > 100e6 and s["peak_mem_bytes_max"] >= peaks["max"][-1]
    assert [m.value for m in _history(run_id, "time_to_target_s")] == [s["time_to_target_s"]]

    # Evaluation in the trainer agrees with an independent scoring of the final weights.
    from training.checkpoint.export import load_exported
    from training.data.dataset import load_split
    from training.evaluate import score

    model, _ = load_exported(tmp_path / "ck" / "step_00000040")
    val = load_split(dataset, "validation")
    ref = score(model, "tabular", torch.from_numpy(val.features), torch.from_numpy(val.labels))
    assert _history(run_id, "eval/accuracy")[-1].value == pytest.approx(ref["eval/accuracy"], abs=1e-9)
    assert _history(run_id, "eval/loss")[-1].value == pytest.approx(ref["eval/loss"], rel=1e-4)

    # Run summary: two restarts lost time; device-hours are ranks x wall.
    assert 0 < s["goodput"] < 1
    assert s["lost_to_restarts_s"] > 0
    assert s["total_samples"] == 40 * BATCH
    assert s["device_hours"] == pytest.approx(2 * s["train_wall_s"] / 3600)
    assert s["device_hours_lost_to_restarts"] == pytest.approx(2 * s["lost_to_restarts_s"] / 3600)
    assert s["productive_s"] + s["lost_to_restarts_s"] <= s["train_wall_s"]
    assert s["peak_mem_bytes_rank_0"] > 50 * 2**20 and s["peak_mem_bytes_rank_1"] > 50 * 2**20  # torch alone
    run = MlflowClient().get_run(run_id)
    assert float(run.data.tags["summary.goodput"]) == pytest.approx(s["goodput"], rel=1e-7)
    assert run.data.tags["progress"] == "40/40 steps (100%)"
    # MLflow system metrics went into the same run (no second run was created).
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(run.data.metrics)
    exp = MlflowClient().get_run(run_id).info.experiment_id
    assert not [r for r in MlflowClient().search_runs([exp]) if r.info.run_name == "retried" and r.info.run_id != run_id]


def test_lineage_summary_counts_replayed_steps_and_downtime_as_lost():
    # Attempt A: steps 1..3 (1 s each) ending at t=1,2,3; it dies; attempt B resumes from step 2,
    # starts at t=10 and redoes step 3 (ends t=11) and step 4 (t=12).
    a = [{"step": i, "step_s": 1.0, "t": float(i), "attempt": "A"} for i in (1, 2, 3)]
    b = [{"step": 3, "step_s": 1.0, "t": 11.0, "attempt": "B"}, {"step": 4, "step_s": 1.0, "t": 12.0, "attempt": "B"}]
    got = lineage_summary(a + b, start=0.0, end=12.0)
    assert got["productive_s"] == 4.0  # steps 1, 2 (A) and 3, 4 (B)
    assert got["lost_to_restarts_s"] == 8.0  # from the end of step 2 (t=2) to the start of the redone step 3 (t=10)
    assert got["goodput"] == pytest.approx(4.0 / 12.0)


def test_a_measured_peak_is_kept_per_machine_threads_and_precision(tmp_path, monkeypatch):
    """A second run on the same machine, precision and thread count reuses the measured peak (its
    own run folder keeps it too, for restarts); another thread count or precision measures anew."""
    import training.metrics.peak as m

    measured = []
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "machine"))
    monkeypatch.setattr(m, "measure_matmul_flops", lambda device, precision: measured.append(precision) or 1e9 * len(measured))
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    first = peak_flops(cpu, "fp32", tmp_path / "run1" / "peak_flops.json")
    second = peak_flops(cpu, "fp32", tmp_path / "run2" / "peak_flops.json")
    assert first == second == (1e9, f"measured: cpu matmul 512x512 fp32, {threads} threads") and measured == ["fp32"]
    assert json.loads((tmp_path / "run2" / "peak_flops.json").read_text())["peak_flops"] == 1e9
    assert peak_flops(cpu, "bf16", None)[0] == 2e9 and measured == ["fp32", "bf16"]
    try:
        torch.set_num_threads(threads + 1)
        assert peak_flops(cpu, "fp32", None)[0] == 3e9, "another thread count is another peak"
    finally:
        torch.set_num_threads(threads)
    assert peak_flops(cpu, "fp32", None)[0] == 1e9 and len(measured) == 3


def test_device_seconds_charge_each_attempt_its_own_world_size():
    # Attempt A on 2 ranks until its last step at t=3; attempt B on 1 rank (an elastic scale-down)
    # from there to the end at t=12: 3 s x 2 + 9 s x 1. The restart's dead time (t=2..10) is lost
    # time of B's single rank.
    a = [{"step": i, "step_s": 1.0, "t": float(i), "attempt": "A", "world": 2} for i in (1, 2, 3)]
    b = [{"step": 3, "step_s": 1.0, "t": 11.0, "attempt": "B", "world": 1},
         {"step": 4, "step_s": 1.0, "t": 12.0, "attempt": "B", "world": 1}]
    got = lineage_summary(a + b, start=0.0, end=12.0, world_size=1)
    assert got["device_s"] == 3 * 2 + 9 * 1
    assert got["lost_device_s"] == 8.0 * 1
    # Records without a world size (written before it was recorded): the caller's.
    old = [{k: v for k, v in r.items() if k != "world"} for r in a]
    assert lineage_summary(old, start=0.0, end=3.0, world_size=4)["device_s"] == 12.0


def test_peak_table_picks_the_gpu_and_precision():
    assert _table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert _table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert _table_peak("NVIDIA A10G", "fp16") == 125e12
    assert _table_peak("Tesla V100-SXM2-16GB", "fp16") == 125e12
    assert _table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 unit: measured instead
    assert _table_peak("Some Future GPU", "bf16") is None


def test_target_needs_evaluation_and_a_known_metric():
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="d", target_metric="eval/accuracy", target_value=0.9)
    assert e.value.field == "target_metric" and "eval_every" in str(e.value)
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="d", eval_every=10, target_metric="train/loss", target_value=0.5)
    assert e.value.field == "target_metric"
    with pytest.raises(ConfigError) as e:
        TrainConfig(dataset_uri="d", eval_every=10, target_metric="eval/accuracy", target_value=80)
    assert e.value.field == "target_value"


def test_eta_is_smoothed_over_log_intervals():
    """The ETA of the progress line and tag: one slow interval (a checkpoint, an evaluation) moves it
    by a fraction of its excess; the warm-up interval only seeds it until the first steady one."""
    from training.metrics.steps import EtaSmoother
    from training.tracking.run import progress_text

    eta = EtaSmoother()
    assert eta.update(10, 5.0, first=True) == pytest.approx(0.5)  # warm-up: 10x slower than steady
    assert eta.update(10, 0.5) == pytest.approx(0.05), "the first steady interval replaces the warm-up"
    assert eta.update(10, 0.5) == pytest.approx(0.05)
    slow = eta.update(10, 4.0)  # one interval 8x the steady one
    assert slow == pytest.approx(0.05 + 0.3 * (0.4 - 0.05)) and slow < 0.4 / 2
    assert progress_text(120, 300, 72.4) == "120/300 steps (40%), ETA 1m12s"
    assert progress_text(300, 300, 0.0) == "300/300 steps (100%)"


def test_step_records_are_read_as_a_stream_and_the_last_from_the_end(tmp_path):
    """A long run writes millions of step records: the summary reads them once as a stream, and
    the last record (a restart's fault accounting, a drill's progress) comes from the file's end,
    skipping a line a crash cut short."""
    n = 20_000
    with open(tmp_path / StepLog.NAME, "w") as f:
        for i in range(1, n + 1):
            attempt = "A" if i <= 15_000 else "B"  # B resumed from step 15,000 after a 5 s outage
            t = float(i) if attempt == "A" else float(i) + 5.0
            f.write(json.dumps({"step": i, "step_s": 1.0, "t": t, "attempt": attempt, "world": 2}) + "\n")
        f.write('{"step": 20001, "step_s": 1.')  # the crash
    assert StepLog.last(tmp_path) == {"step": n, "step_s": 1.0, "t": n + 5.0, "attempt": "B", "world": 2}
    stream = StepLog.iter(tmp_path)
    assert not isinstance(stream, list)
    got = lineage_summary(stream, start=0.0, end=n + 5.0)
    assert got["productive_s"] == n and got["lost_to_restarts_s"] == 5.0 and got["lost_device_s"] == 10.0
    assert got["device_s"] == (n + 5.0) * 2
    assert StepLog.last(tmp_path / "missing") is None
