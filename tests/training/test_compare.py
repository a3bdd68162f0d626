"""The comparison report computes the right figures from what runs logged.

Runs are written into the real MLflow store with known values (what the trainer would log), so
every number in the report has a ground truth: scaling efficiency, medians, the differing params.
"""

import json
import subprocess
import sys

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from training.results.compare import scaling_points, select_runs, summarize


def _log_run(client, exp_id, *, world_size, samples_per_s, strategy="ddp", comm_hook="none", step_s=0.01, comm_s=0.004,
             exposed=None,
             losses=(1.4, 1.0, 0.7), accuracy=0.8, run_name=None):
    run = client.create_run(exp_id, run_name=run_name)
    rid = run.info.run_id
    params = {"world_size": world_size, "strategy": strategy, "comm_hook": comm_hook, "steps": 30, "lr": 0.003, "batch_size": 64,
              "checkpoint_dir": f"/w/{rid}/ckpt", "config_hash": rid[:16]}
    metrics = []
    for i, loss in enumerate(losses, start=1):
        step = 10 * i
        metrics += [Metric("train/loss", loss, 0, step), Metric("perf/step_s", step_s, 0, step),
                    Metric("comm/s_per_step", comm_s, 0, step)]
        # first interval is warm-up: slower; the median ignores it
        metrics.append(Metric("perf/samples_per_s", samples_per_s * (0.5 if i == 1 else 1.0), 0, step))
        if exposed is not None:
            metrics.append(Metric("comm/exposed_fraction", exposed, 0, step))
    metrics += [Metric("eval/accuracy", accuracy, 0, 30), Metric("eval/loss", 0.6, 0, 30)]
    client.log_batch(rid, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()],
                     tags=[RunTag("world_size", str(world_size))])
    client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture
def experiment(tmp_path):
    client = MlflowClient()
    name = f"compare-{tmp_path.name}"
    exp_id = client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    return client, name, exp_id


def test_scaling_efficiency_is_per_rank_throughput_over_one_rank(experiment):
    client, name, exp_id = experiment
    # ddp: 1000 samples/s on 1 rank, 1800 on 2 ranks -> per-rank 900 -> efficiency 0.9; 4 ranks 3000 -> 0.75
    for ws, thr in ((1, 1000.0), (2, 1800.0), (4, 3000.0)):
        _log_run(client, exp_id, world_size=ws, samples_per_s=thr)
    _log_run(client, exp_id, world_size=2, samples_per_s=1500.0, strategy="fsdp")  # no 1-rank baseline
    # compressed gradients on 2 ranks: compared with the plain 1-rank run (nothing to compress on one rank)
    _log_run(client, exp_id, world_size=2, samples_per_s=1600.0, comm_hook="fp16")
    points = scaling_points(summarize(client, select_runs(client, name, last=10)))
    ddp = {p["world_size"]: p for p in points["comm_hook=none, strategy=ddp"]}
    assert ddp[1]["samples_per_s"] == 1000.0  # the median skipped the slow warm-up interval
    assert ddp[2]["efficiency"] == pytest.approx(0.9)
    assert ddp[4]["efficiency"] == pytest.approx(0.75)
    (fp16,) = points["comm_hook=fp16, strategy=ddp"]
    assert fp16["efficiency"] == pytest.approx(0.8)
    (fsdp,) = points["comm_hook=none, strategy=fsdp"]
    assert fsdp["efficiency"] != fsdp["efficiency"], "no baseline: efficiency is NaN, not a made-up number"


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_report_files_and_table_rows(experiment, tmp_path):
    client, name, exp_id = experiment
    old = _log_run(client, exp_id, world_size=1, samples_per_s=1000.0, run_name="old")
    a = _log_run(client, exp_id, world_size=1, samples_per_s=1000.0, exposed=0.25, run_name="one-rank")
    b = _log_run(client, exp_id, world_size=2, samples_per_s=1800.0, exposed=0.4, run_name="two-ranks")
    failed = client.create_run(exp_id).info.run_id
    client.set_terminated(failed, "FAILED")

    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "training", "compare", "--experiment", name, "--last", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["runs"] == [a, b], "the last 2 finished runs, oldest first"
    for f in ("report.md", "report.html", "scaling.png", "step_time.png", "loss.png"):
        assert (out / f).stat().st_size > 1000 or f.endswith((".md", ".html")), f
    assert not (out / "time_to_target.png").exists(), "no run logged time_to_target_s"
    assert all((out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in ("scaling.png", "step_time.png", "loss.png"))

    md = (out / "report.md").read_text()
    rows = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith("| run")]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == [a, b]
    assert old not in md and failed not in md
    header = next(l for l in md.splitlines() if l.startswith("| run"))
    assert "world_size" in header and "strategy" not in header, "only params that differ are columns"
    assert "checkpoint_dir" not in header, "per-run paths are noise, not a difference"
    assert "| 1,800 |" in rows[1] and "40.0%" in rows[1]  # median throughput, exposed share
    html = (out / "report.html").read_text()
    assert a in html and b in html and '<img src="scaling.png"' in html


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_unknown_experiment_is_bad_input(tmp_path):
    result = subprocess.run([sys.executable, "-m", "training", "compare", "--experiment", "no-such-experiment",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "experiment 'no-such-experiment' does not exist" in result.stderr
