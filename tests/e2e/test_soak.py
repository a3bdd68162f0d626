"""The soak's assertions in two minutes (benchmarks/soak.py; the hour-long run's figures are in
docs/benchmarks.md): a real 2-rank torchrun group checkpointing every 15 s (some seven checkpoints
through a keep-last-3 retention), watched from outside: disk bounded by retention, each rank's memory flat, CPU time per step no more than a
fresh twin's beside it at the end (the old process against a new one on the same machine at the
same time, so that load from other tests weighs on both), one MLflow point per log interval, and a
clean preemption at the end. Paced at 5 ms a step (``--pace-ms``: the ranks sleep in the
all-reduce), it does some 12,000 steps in 122 CPU seconds instead of 31,000 in 215, and leaves
the cores to the tests beside it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.budget(300, reason="two minutes of training are what it watches for growth and drift")
def test_two_minutes_of_training_neither_grow_nor_drift(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "2",
                          "--checkpoint-every-s", "15", "--sample-s", "4", "--pace-ms", "5", "--check",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok  ") == 5
