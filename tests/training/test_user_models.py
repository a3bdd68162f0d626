"""Your own model: a factory ``package.module:function`` from a module outside the package,
handed the model spec, refused before any rank starts when it cannot be used (the factory path
and the error named, exit code 2), rebuilt from model_config.json without pickle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.checkpoint.export import load_exported
from training.config.train_config import TrainConfig
from training.data.dataset import open_dataset
from training.config.fields import ConfigError
from training.models.build import OUTER_UNIT_MIN_NUMEL, fsdp_layout, shard_units, used_last
from training.train import prepare

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

MODULE = '''
import torch
from torch import nn


def wrong_width(spec):
    return nn.Linear(spec["in_features"], spec["n_classes"] + 2)


def raises(spec):
    raise ValueError("model_args.width must be even, got " + str(spec["model_args"].get("width")))


def not_a_module(spec):
    return "a model"


class Stray(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.body = nn.Linear(spec["in_features"], spec["n_classes"])
        self.fsdp_units = [nn.Linear(2, 2)]  # not a part of this model

    def forward(self, x):
        return self.body(x)


def stray_units(spec):
    return Stray(spec)


def seen(spec):
    # What the factory was handed, for the test to read back.
    import json, os
    with open(os.environ["SEEN_SPEC"], "w") as f:
        json.dump(spec, f)
    return nn.Linear(spec["in_features"], spec["n_classes"])
'''


@pytest.fixture(scope="module")
def user_code(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "team_models.py").write_text(MODULE)
    sys.path.insert(0, str(folder))
    sys.path.insert(0, str(EXAMPLES))
    yield folder
    sys.path.remove(str(folder))
    sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """A classification and a regression table, no metadata."""
    root = tmp_path_factory.mktemp("tables")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4)) * [1, 10, 100, 1000]
    pq.write_table(pa.table({**{f"x{i}": x[:, i] for i in range(4)}, "y": (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0)}),
                   root / "classes.parquet")
    pq.write_table(pa.table({**{f"x{i}": x[:, i] for i in range(4)}, "y": 3 * x[:, 0] + x[:, 1] / 10 + 50}),
                   root / "numbers.parquet")
    return root


def _cfg(tables, name="classes", **kw):
    return TrainConfig(dataset_uri=str(tables / f"{name}.parquet"), label_column="y", checkpoint_dir="-", **kw)


@pytest.mark.parametrize("model, strategy, error", [
    ("no_such_module:build", "ddp", "no_such_module:build: ModuleNotFoundError: No module named 'no_such_module'"),
    ("team_models:missing", "ddp", "team_models:missing: AttributeError: module 'team_models' has no attribute 'missing'"),
    ("team_models:raises", "ddp", "team_models:raises: ValueError: model_args.width must be even, got 3"),
    ("team_models:not_a_module", "ddp", "team_models:not_a_module: TypeError: returned a str, not a torch.nn.Module"),
    ("team_models:wrong_width", "ddp", "team_models:wrong_width: a batch of 2 rows gave output (2, 6), but tabular "
     "classification over 4 classes needs (2, 4)"),
    ("team_models:stray_units", "fsdp", "team_models:stray_units: ValueError: fsdp_units must be sub-modules of the "
     "model, got Linear"),
])
def test_an_unusable_factory_is_refused_naming_it(user_code, tables, model, strategy, error):
    with pytest.raises(ConfigError) as err:
        prepare(_cfg(tables, model=model, strategy=strategy, model_args={"width": 3}))
    assert err.value.field == "model" and error in str(err.value), str(err.value)
    assert "Fix: make the factory importable" in str(err.value)


def test_a_regression_output_must_be_one_number_per_row(user_code, tables):
    with pytest.raises(ConfigError) as err:
        prepare(_cfg(tables, "numbers", model="team_models:wrong_width"))
    assert "a batch of 2 rows gave output (2, 3), but tabular regression needs (2,)" in str(err.value)


def test_the_factory_gets_the_spec_and_model_args_untouched(user_code, tables, tmp_path, monkeypatch):
    monkeypatch.setenv("SEEN_SPEC", str(tmp_path / "spec.json"))
    args = {"width": 8, "layers": [4, 2], "act": {"name": "gelu"}}
    prepare(_cfg(tables, model="team_models:seen", model_args=args))
    seen = json.loads((tmp_path / "spec.json").read_text())
    assert seen["model_args"] == args
    assert (seen["kind"], seen["task"], seen["in_features"], seen["n_classes"]) == ("tabular", "classification", 4, 4)
    assert seen["features"] == ["x0", "x1", "x2", "x3"] and seen["classes"] == [0, 1, 2, 3]
    prepare(_cfg(tables, "numbers", model="team_models:seen"))
    seen = json.loads((tmp_path / "spec.json").read_text())
    assert (seen["task"], seen["n_classes"]) == ("regression", 1)
    assert set(seen["target"]) == {"mean", "std"} and len(seen["normalization"]["mean"]) == 4


def test_fsdp_units_come_from_the_model_or_its_children(user_code):
    from resmlp import ResidualMLP  # examples/resmlp.py
    from torch import nn

    model = ResidualMLP(4, 3, blocks=2)
    assert shard_units(model) == [model.stem, model.blocks[0], model.blocks[1], model.head]
    plain = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    assert shard_units(plain) == [plain[0], plain[2]]  # each direct child holding parameters


def test_fsdp_shards_a_large_embedding_and_head_apart_from_the_root_unless_tied():
    """The root's parameters stay gathered for the whole step; a large vocabulary's embedding and
    head become units of their own, a small one and a tied pair stay with the root."""
    from torch import nn

    from training.metrics.memory import count_step
    from training.models.builtin import Transformer
    from training.models.spec import ModelSpec

    vocab = OUTER_UNIT_MIN_NUMEL // 64
    big = Transformer(vocab_size=vocab, seq_len=8, d_model=64, n_layers=2, n_heads=4)
    assert fsdp_layout(big) == [*big.blocks, big.tok, big.head]  # the norm (64 parameters) stays with the root
    assert used_last(big, fsdp_layout(big)) == [big.head]  # kept gathered from its forward to its backward
    small = Transformer(vocab_size=vocab // 2, seq_len=8, d_model=64, n_layers=2, n_heads=4)
    assert fsdp_layout(small) == list(small.blocks)
    tied = Transformer(vocab_size=vocab, seq_len=8, d_model=64, n_layers=2, n_heads=4)
    tied.head.weight = tied.tok.weight
    assert fsdp_layout(tied) == list(tied.blocks)
    plain = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    assert fsdp_layout(plain) == shard_units(plain)  # every parameter already in a unit
    # The memory estimate counts the same layout: the largest unit is now the embedding, the root its norm.
    meta = {"kind": "tokens", "task": "language_modeling", "features": ["tokens"], "vocab_size": vocab, "seq_len": 8}
    counted = count_step(ModelSpec.for_data("transformer", meta, hidden=64, depth=2, n_heads=4), (9,), "int64",
                         micro_batch=1, activation_checkpointing="none", precision="fp32")
    assert (counted.largest_unit_numel, counted.root_numel) == (vocab * 64, 64)


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_cli_refuses_a_broken_factory_with_exit_2_before_any_rank(user_code, tables, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_code), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "training", "train", "--set", f"dataset_uri={tables / 'classes.parquet'}",
                          "--set", "label_column=y", "--set", "model=team_models:not_a_module",
                          "--set", f"checkpoint_dir={tmp_path / 'ck'}"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 2
    assert ("error: config field 'model': team_models:not_a_module: TypeError: returned a str, not a torch.nn.Module"
            in out.stderr)
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_a_trained_factory_model_is_rebuilt_from_its_config(user_code, tables, tmp_path):
    """One rank, a few steps: model_config.json names the factory and its arguments and holds the
    data transform; rebuilding from it (no pickle) predicts what the trainer's model predicted."""
    from tests.conftest import run_torchrun

    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])}
    proc = run_torchrun(1, [f"dataset_uri={tables / 'numbers.parquet'}", "label_column=y",
                            "model=resmlp:residual_mlp", 'model_args={"width": 16, "blocks": 1}',
                            f"checkpoint_dir={tmp_path / 'ck'}", "steps=40", "batch_size=32", "checkpoint_every=0",
                            "log_every=20", "eval_every=20"], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "eval step 40: loss" in proc.stdout and "| rmse" in proc.stdout and "| r2" in proc.stdout
    final = tmp_path / "ck" / "step_00000040"
    config = json.loads((final / "model_config.json").read_text())
    assert (config["model"], config["model_args"], config["task"]) == ("resmlp:residual_mlp",
                                                                       {"width": 16, "blocks": 1}, "regression")
    model, spec = load_exported(final)
    ds = open_dataset(tables / "numbers.parquet", _options())
    val = ds.split("validation", spec)
    with torch.no_grad():
        pred = model(torch.from_numpy(val.features))
    assert pred.shape == (len(val.labels),)
    # Predictions come back in the label's units (the label is around 50, the spread about 3).
    assert abs(float(pred.mean()) - float(val.labels.mean())) < 3.0


def _options():
    from training.data.options import DataOptions

    return DataOptions(label_column="y")
