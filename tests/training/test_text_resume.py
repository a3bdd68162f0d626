"""Exact resume of a language model on text: a rank SIGKILLed between two checkpoints, torchrun
restarts the group, which resumes from the newest checkpoint; the final weights are bit-identical
to an uninterrupted run's (DDP and FSDP2, dropout on: the RNG streams are restored too). The killed
run also recomputes its activations (activation_checkpointing: selective with DDP, full with
FSDP2), which must change nothing either."""

import hashlib
import json

import pytest

from tests.conftest import run_torchrun
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.synthetic import make_text_dataset
from training.data.text import documents
from training.data.tokenizer import resolve
from training.data.tokens import build

STEPS = 30
RECOMPUTE = {"ddp": "activation_checkpointing=selective", "fsdp": "activation_checkpointing=full"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-resume")
    make_text_dataset(root / "data")
    ds = open_dataset(root / "data", DataOptions(text_column="text"))
    tok = resolve("bpe:400", train_documents=lambda: documents(ds.table("train"), "text"))
    return root / "data", build(ds, text_column="text", tokenizer=tok, seq_len=32, store_uri=str(root / "store")).uri


def _sets(data, uri, root, strategy):
    base = {"dataset_uri": data, "text_column": "text", "token_shards": uri, "model": "transformer", "hidden": 64,
            "depth": 2, "n_heads": 4, "seq_len": 32, "dropout": 0.1, "steps": STEPS, "checkpoint_every": 10,
            "batch_size": 16, "log_every": 5, "warmup_steps": 5, "strategy": strategy,
            "checkpoint_dir": root / "ck", "output_dir": root / "out"}
    return [f"{k}={v}" for k, v in base.items()]


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _final(root, steps=STEPS):
    return hashlib.sha256((root / "ck" / f"step_{steps:08d}" / "model.safetensors").read_bytes()).hexdigest()


def _losses(root):
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in (root / "out" / "steps.jsonl").read_text().splitlines()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_language_model_killed_mid_run_resumes_bit_identical(shards, tmp_path, strategy):
    data, uri = shards
    base, killed = tmp_path / "base", tmp_path / "killed"
    _ok(run_torchrun(2, _sets(data, uri, base, strategy)))
    proc = _ok(run_torchrun(2, [*_sets(data, uri, killed, strategy), RECOMPUTE[strategy]], max_restarts=1,
                            env={"TRAINING_FAULT_KILL_AT_STEP": "15:1"}))
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout and "(step 10)" in proc.stdout
    assert _final(killed) == _final(base)
    got, want = _losses(killed), _losses(base)
    assert [got[s] for s in range(11, STEPS + 1)] == [want[s] for s in range(11, STEPS + 1)]
    config = json.loads((killed / "ck" / f"step_{STEPS:08d}" / "model_config.json").read_text())
    assert config["kind"] == "tokens" and config["task"] == "language_modeling" and config["tokenizer_sha256"]
    assert (killed / "ck" / f"step_{STEPS:08d}" / "tokenizer.json").is_file(), "the model is exported with its tokenizer"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_hugging_face_model_killed_mid_run_resumes_bit_identical(tmp_path, strategy):
    """A GPT-2 style folder (its dropout on) fine-tuned on its own tokenizer's windows."""
    from tests.hf_models import gpt2_folder

    folder = gpt2_folder(tmp_path / "gpt2", pretrain_steps=0)
    make_text_dataset(tmp_path / "data")
    ds = open_dataset(tmp_path / "data", DataOptions(text_column="text"))
    tok = resolve("", default=str(folder), train_documents=lambda: [])
    uri = build(ds, text_column="text", tokenizer=tok, seq_len=32, store_uri=str(tmp_path / "store")).uri
    model = [f"model=hf:{folder}"]
    base, killed = tmp_path / "base", tmp_path / "killed"
    sets = lambda root: [s for s in _sets(tmp_path / "data", uri, root, strategy) if not s.startswith("model=")] + model
    env = {"HF_HUB_OFFLINE": "1"}
    _ok(run_torchrun(2, sets(base), env=env))
    proc = _ok(run_torchrun(2, [*sets(killed), RECOMPUTE[strategy]], max_restarts=1,
                            env={**env, "TRAINING_FAULT_KILL_AT_STEP": "15:1"}))
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout and "(step 10)" in proc.stdout
    assert _final(killed) == _final(base)
    got, want = _losses(killed), _losses(base)
    assert [got[s] for s in range(11, STEPS + 1)] == [want[s] for s in range(11, STEPS + 1)]
