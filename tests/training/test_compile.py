"""``compile=blocks`` (training/models/compiling.py): a compiled run (FSDP2, activation
checkpointing, two ranks) trains and its losses follow the eager run's; the parameter names are
unchanged; compile time is reported apart. Refused with the field named where it cannot work."""

import json

import pytest
from safetensors import safe_open

from tests.conftest import run_torchrun
from training.config.fields import ConfigError
from training.config.train_config import TrainConfig, check_rules
from training.data.synthetic import make_markov_dataset
from training.metrics.steps import StepLog


def test_compile_is_refused_where_it_cannot_work(monkeypatch):
    with pytest.raises(ConfigError, match="'compile'.*no blocks.*compile=none"):
        check_rules(TrainConfig(dataset_uri="x", model="mlp", compile="blocks"))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="'compile'.*no C\\+\\+ compiler"):
        TrainConfig(dataset_uri="x", model="transformer", compile="blocks").check_device(cuda=False)
    TrainConfig(dataset_uri="x", model="transformer", compile="blocks").check_device(cuda=True)


@pytest.mark.slow
def test_a_compiled_run_trains_like_the_eager_run(tmp_path):
    data = tmp_path / "markov"
    make_markov_dataset(data, n_train=512, n_val=64, seed=0)
    procs = {}
    for mode in ("none", "blocks"):  # side by side: most of each run is starting up
        out = tmp_path / mode
        # aot_eager: dynamo's tracing and AOTAutograd as with inductor, without the minutes of C++ builds.
        procs[mode] = run_torchrun(2, [f"dataset_uri={data}", "model=transformer", "hidden=32", "depth=2", "n_heads=4",
                                       "strategy=fsdp", "activation_checkpointing=full", f"compile={mode}", "steps=8",
                                       "batch_size=16", "log_every=4", "checkpoint_every=0", "warmup_steps=0",
                                       f"checkpoint_dir={out / 'ck'}", f"output_dir={out}"],
                                   env={"TRAINING_COMPILE_BACKEND": "aot_eager"}, popen=True)
    runs = {}
    for mode, proc in procs.items():
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, output[-3000:]
        runs[mode] = [float.fromhex(r["loss"]) for r in StepLog.read(tmp_path / mode)]
    assert len(runs["blocks"]) == 8 and runs["blocks"][-1] < runs["blocks"][0]
    assert runs["blocks"] == pytest.approx(runs["none"], rel=1e-4)
    summary = json.loads((tmp_path / "blocks" / "train_summary.json").read_text())
    assert summary["compile_s"] > 0 and "compile_s" not in json.loads((tmp_path / "none" / "train_summary.json").read_text())
    names = {}
    for mode in ("none", "blocks"):
        with safe_open(tmp_path / mode / "ck" / "step_00000008" / "model.safetensors", "pt") as f:
            names[mode] = sorted(f.keys())
    assert names["blocks"] == names["none"]
