"""benchmarks/gpu_check.py, the GPU path in one command, run here on CPU with gloo and a small
decoder (so it cannot rot while no GPU is at hand): three real torchrun runs of the trainer (FSDP2
bf16 with activation checkpointing, the same killed and resumed, DDP for the communication
timing), one JSON report whose figures must make sense."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_the_gpu_path_on_cpu_and_reports_one_json(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--small",
                           "--work", str(tmp_path)], capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)  # the whole of stdout is the one report
    assert proc.returncode == 0 and report["ok"], report.get("problems") or proc.stderr[-3000:]
    assert (report["device"], report["backend"], report["world_size"]) == ("cpu", "gloo", 2)
    fsdp = report["fsdp"]
    assert (fsdp["strategy"], fsdp["precision"], fsdp["activation_checkpointing"]) == ("fsdp", "bf16", "full")
    assert 0 < fsdp["mfu"] < 1 and fsdp["step_s"] > 0 and fsdp["tokens_per_s"] > 0 and fsdp["peak_mem_bytes_max"] > 0
    assert report["model"]["n_params"] > 10_000  # the decoder the fields describe, counted by the trainer
    resume = report["resume"]
    assert resume["restarts"] == 1 and resume["resumed_from"].endswith(f"step_{resume['checkpoint_every']:08d}")
    assert resume["model_bytes_identical"] and resume["losses_identical"] and resume["max_abs_weight_diff"] == 0.0
    assert resume["steps_compared"] == report["fsdp"]["steps"] - resume["checkpoint_every"]
    comm = report["comm"]
    assert comm["strategy"] == "ddp" and comm["timed_with"] == "cpu_clock"
    assert comm["collectives_per_step"] >= 1 and comm["bytes_per_step"] >= 4 * report["model"]["n_params"]
    assert 0 <= comm["exposed_fraction"] <= 1 and comm["in_flight_s_per_step"] > 0
