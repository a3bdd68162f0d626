"""Soak: one long training run that checkpoints about once a minute with retention, watched from
outside. Checks that nothing grows or drifts with time.

    .venv/bin/python benchmarks/soak.py --minutes 60                 # the full soak (figures in docs/benchmarks.md)
    .venv/bin/python benchmarks/soak.py --minutes 2 --pace-ms 5 --check   # the CI version: exit 1 when a check fails

A real `torchrun` group (2 gloo ranks on loopback) trains the MLP on the teacher data with
`checkpoint_every` set from a short calibration run so that checkpoints come about every
`--checkpoint-every-s` seconds, `retention_keep_last=3`, and a real MLflow run (SQLite store in the
output folder). Every `--sample-s` seconds the script records the checkpoint folder's size and
each rank's resident memory (/proc). After `--minutes` it sends SIGTERM (a preemption: the ranks
agree on a step, checkpoint it and exit 75), then prints the figures and checks:

- disk: the checkpoint folder never holds more than `keep_last` + 2 checkpoints' worth (retention
  works while training; one in flight, one kept as the best by evaluation);
- memory: each rank's RSS in the last tenth of the run is within `--rss-drift` of the second tenth;
- speed: a fresh twin of the run (same configuration, its own MLflow run and folders) starts for
  the last `--twin-s` seconds, and the soaked ranks' CPU time per step (user + system, from /proc)
  over that window must be within `--step-drift` of the twin's over the same window: the old
  process against a new one, side by side, so that whatever else the machine runs weighs on both
  (the twin's first steps, its start-up, are not counted; on a loaded machine the soak runs on
  until the twin has been measured beside it, at most `TWIN_WAIT_S` more). Neither wall time nor CPU time of one
  run early against late holds on a shared machine: with the other tests beside a 3-minute soak
  the same process's CPU time per step went from 4.2 to 7.5 ms without anything having grown
  (docs/benchmarks.md). Early and late medians of the soaked run are printed too;
- MLflow: `train/loss` has exactly one point per log interval up to the last step.

`--pace-ms D` makes every step's gradient all-reduce complete D ms later (the trainer's
`TRAINING_FAULT_COMM_DELAY_MS`, a sleep where the collective completes): the ranks then sleep most
of each step instead of keeping two cores busy, and the test suite's soak (tests/e2e/test_soak.py)
leaves the CPUs to the tests beside it. The calibration, the run and the twin run at the same
pace, so checkpoints still come every `--checkpoint-every-s` and CPU time per step is compared like
for like; the checks read time and CPU per step, which pacing leaves meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.distributed.launch import torchrun_command  # noqa: E402 (after the path is set)
from training.metrics.steps import StepLog  # noqa: E402
from training.util import free_port  # noqa: E402

LOG_EVERY = 50
MIN_SIDE_BY_SIDE = 4  # samples of the soaked run beside a running twin, for the CPU comparison
TWIN_WAIT_S = 180.0  # how much longer than the soak the twin may take to get there


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (field 3 on: state, ppid, ...), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _children(pid: int) -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := _stat_fields(entry.name)) and int(fields[1]) == pid]


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_step(window: list[dict]) -> float:
    """Both ranks' CPU seconds per step between the first and the last sample of ``window``."""
    first, last = window[0], window[-1]
    steps = last["step"] - first["step"]
    return (sum(last["cpu"]) - sum(first["cpu"])) / steps if steps > 0 else float("nan")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _sets(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def _side_by_side(samples: list[dict]) -> list[dict]:
    """The samples in which both soaked ranks and both of the twin's are measured, the twin past
    its start-up."""
    return [s for s in samples if len(s["cpu"]) == 2 and len(s.get("twin", {}).get("cpu", [])) == 2
            and s["twin"]["step"] >= 2 * LOG_EVERY]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--checkpoint-every-s", type=float, default=60)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--sample-s", type=float, default=10)
    p.add_argument("--rss-drift", type=float, default=0.15, help="allowed relative RSS growth")
    p.add_argument("--step-drift", type=float, default=0.3,
                   help="allowed excess of the soaked ranks' CPU time per step over the fresh twin's")
    p.add_argument("--twin-s", type=float, default=None,
                   help="how long the fresh twin runs at the end (default: a tenth of the soak, 40-120 s)")
    p.add_argument("--pace-ms", type=float, default=0,
                   help="each step's gradient all-reduce completes this much later: the ranks sleep, not spin")
    p.add_argument("--check", action="store_true", help="exit 1 when a check fails")
    p.add_argument("--out", default=None, help="working folder (default: a temporary one)")
    a = p.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    if a.pace_ms > 0:
        env["TRAINING_FAULT_COMM_DELAY_MS"] = f"{a.pace_ms:g}"
    data = work / "data"
    if not (data / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "training", "make-data", "--out", str(data)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    base = {"dataset_uri": data, "batch_size": 64, "log_every": LOG_EVERY, "eval_every": 0, "seed": 1}

    # Calibration: the step time of this machine, to space the checkpoints in time.
    cal = work / "calibrate"
    cmd = torchrun_command(_sets({**base, "steps": 200, "checkpoint_every": 0, "checkpoint_dir": cal / "ck",
                                  "output_dir": cal / "out"}), nproc_per_node=2, master_port=free_port())
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    step_s = statistics.median(r["step_s"] for r in _steps(cal / "out")[50:])
    every = max(10, round(a.checkpoint_every_s / max(step_s, 1e-4)))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("soak") or client.get_experiment(client.create_experiment("soak"))
    run_id = client.create_run(exp.experiment_id, run_name=f"soak {a.minutes:g} min").info.run_id

    def launch(name: str, run: str):
        folder = work / name
        cmd = torchrun_command(_sets({**base, "steps": 10_000_000, "checkpoint_every": every,
                                      "checkpoint_dir": folder / "ck", "output_dir": folder / "out",
                                      "retention_keep_last": a.keep_last}), nproc_per_node=2, master_port=free_port())
        log = open(work / f"{name}.log", "w")
        return subprocess.Popen(cmd, env={**env, "MLFLOW_RUN_ID": run}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def sample(agent, out: Path) -> dict:
        ranks = sorted(_children(agent.pid))
        return {"step": (StepLog.last(out) or {}).get("step", 0),
                "rss": [r for r in (_rss_mib(pid) for pid in ranks) if r is not None],
                "cpu": [c for c in (_cpu_s(pid) for pid in ranks) if c is not None]}

    total_s = a.minutes * 60
    twin_s = a.twin_s if a.twin_s is not None else min(max(40.0, total_s / 10), 120.0)
    ck, out = work / "run" / "ck", work / "run" / "out"
    paced = f", paced {a.pace_ms:g} ms" if a.pace_ms else ""
    print(f"soak: {a.minutes:g} min, step {1000 * step_s:.2f} ms (calibrated{paced}), checkpoint every {every} steps, "
          f"keep last {a.keep_last}, a fresh twin for the last {twin_s:g} s; {work}", flush=True)
    agent, twin = launch("run", run_id), None
    samples = []  # the soaked run every sample_s; while the twin runs, each sample holds both
    t0 = time.monotonic()
    while agent.poll() is None:
        elapsed = time.monotonic() - t0
        # Past the soak's length, the twin still gets until it is measured beside the run (its
        # start-up takes longer on a loaded machine), at most TWIN_WAIT_S more.
        if elapsed >= total_s and (twin is None or len(_side_by_side(samples)) >= MIN_SIDE_BY_SIDE
                                   or elapsed >= total_s + TWIN_WAIT_S):
            break
        time.sleep(a.sample_s)
        if twin is None and time.monotonic() - t0 >= total_s - twin_s:
            twin = launch("twin", client.create_run(exp.experiment_id, run_name="soak twin").info.run_id)
        samples.append({"t": time.monotonic() - t0, "disk": _size(ck), **sample(agent, out)})
        if twin is not None:
            samples[-1]["twin"] = sample(twin, work / "twin" / "out")
    for proc in (agent, twin):
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # a preemption: checkpoint the agreed step, exit 75
    for proc in (agent, twin):
        if proc is not None:
            proc.wait(timeout=300)
    preempted = "preempted; checkpoint written at step" in (work / "run.log").read_text()

    records = _steps(out)
    last = records[-1]["step"] if records else 0
    one_ckpt = max((_size(d) for d in ck.glob("step_*")), default=0)
    tenth = max(1, len(records) // 10)
    early, late = records[tenth:2 * tenth], records[-tenth:]
    step_early = statistics.median(r["step_s"] for r in early) if early else float("nan")
    step_late = statistics.median(r["step_s"] for r in late) if late else float("nan")
    rss = [s["rss"] for s in samples if len(s["rss"]) == 2]
    k = max(1, len(rss) // 10)
    rss_early = [statistics.median(r[i] for r in rss[k:2 * k]) for i in range(2)] if len(rss) >= 3 else []
    rss_late = [statistics.median(r[i] for r in rss[-k:]) for i in range(2)] if len(rss) >= 3 else []
    cpu = [s for s in samples if len(s["cpu"]) == 2 and "twin" not in s]
    k = max(2, len(cpu) // 10)
    cpu_early = _cpu_per_step(cpu[k:2 * k]) if len(cpu) >= 3 * k else float("nan")
    cpu_late = _cpu_per_step(cpu[-k:]) if len(cpu) >= 3 * k else float("nan")
    # Side by side: from the first sample where the twin is past its start-up to the last.
    both = _side_by_side(samples)
    cpu_soaked = _cpu_per_step(both) if len(both) >= 2 else float("nan")
    cpu_twin = _cpu_per_step([s["twin"] for s in both]) if len(both) >= 2 else float("nan")
    losses = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    expected = list(range(LOG_EVERY, last - last % LOG_EVERY + 1, LOG_EVERY))
    disk_max = max((s["disk"] for s in samples), default=0)
    checks = {
        "SIGTERM: the ranks agreed on a step and checkpointed it": preempted,
        f"disk <= {a.keep_last + 2} checkpoints": disk_max <= (a.keep_last + 2) * max(one_ckpt, 1),
        f"rss drift <= {a.rss_drift:.0%}": bool(rss_early) and all(
            l <= e * (1 + a.rss_drift) for e, l in zip(rss_early, rss_late)),
        f"CPU time per step within {a.step_drift:.0%} of a fresh twin's": cpu_soaked <= cpu_twin * (1 + a.step_drift),
        "train/loss once per interval": losses[: len(expected)] == expected and len(losses) in (len(expected),
                                                                                               len(expected) + 1),
    }
    figures = {"minutes": a.minutes, "steps": last, "checkpoints_kept": sorted(d.name for d in ck.glob("step_*")),
               "checkpoint_mib": one_ckpt / 2**20, "disk_max_mib": disk_max / 2**20,
               "rss_mib_early": rss_early, "rss_mib_late": rss_late, "step_ms_early": 1000 * step_early,
               "step_ms_late": 1000 * step_late, "cpu_ms_per_step_early": 1000 * cpu_early,
               "cpu_ms_per_step_late": 1000 * cpu_late, "cpu_ms_per_step_beside_twin": 1000 * cpu_soaked,
               "twin_cpu_ms_per_step": 1000 * cpu_twin, "twin_seconds_compared": both[-1]["t"] - both[0]["t"] if both else 0,
               "train_loss_points": len(losses),
               "load_avg_1min": os.getloadavg()[0]}
    (work / "samples.json").write_text(json.dumps(samples))  # disk, step, each rank's RSS and CPU over time
    print(json.dumps(figures, indent=2))
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 1 if a.check and not all(checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
