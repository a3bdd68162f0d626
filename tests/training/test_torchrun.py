"""Real torchrun, two ranks, gloo over loopback: DDP keeps the replicas bit-identical."""

import json
import re

import pytest
from safetensors.torch import load_file

from tests.conftest import run_torchrun


def _torchrun(nproc, *sets, timeout=240):
    return run_torchrun(nproc, list(sets), timeout=timeout)


@pytest.mark.smoke_torchrun  # make test-fast's one torchrun (tests/processes.py)
def test_two_ranks_stay_identical_after_every_step(dataset, tmp_path):
    steps = 12
    out = _torchrun(2, f"dataset_uri={dataset}", f"checkpoint_dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}",
                    f"steps={steps}", "batch_size=32", "log_every=4", "checkpoint_every=5", "replica_check_every=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    checks = re.findall(r"replica check step (\d+): identical on 2 ranks sha256=([0-9a-f]+)", out.stdout)
    assert [int(s) for s, _ in checks] == list(range(1, steps + 1))
    assert len({h for _, h in checks}) == steps, "weights must change every step"
    # Only rank 0 prints progress: one line per log interval, not one per rank.
    assert [int(s) for s in re.findall(r"^step (\d+)/12 ", out.stdout, re.M)] == [4, 8, 12]
    # Periodic checkpoints at 5 and 10, and the final one with the exported model.
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000005", "step_00000010", "step_00000012"]
    final = ck / "step_00000012"
    assert json.loads((ck / "latest").read_text())["step_dir"] == final.name
    manifest = json.loads((final / "manifest.json").read_text())
    assert {f["path"] for f in manifest["files"]} == {".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt",
                                                      "rng_rank1.pt", "model.safetensors", "model_config.json"}
    weights = load_file(str(final / "model.safetensors"))
    assert "net.0.weight" in weights  # plain module names, no DDP "module." prefix
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["final_step"] == steps and summary["world_size"] == 2


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_bad_config_exits_before_any_process_group(dataset, tmp_path):
    out = _torchrun(2, f"dataset_uri={dataset}", f"checkpoint_dir={tmp_path}", "batch_size=33")
    assert out.returncode != 0
    assert "config field 'batch_size': 33 is not divisible by world_size=2" in out.stdout + out.stderr
