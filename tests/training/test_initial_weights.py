"""Initial weights set after sharding (training/models/materialize.py), for real: torchrun ranks
build the model on the meta device, shard it with FSDP2 and fill only their shards; the whole state
gathered afterwards must not depend on how many ranks there were, and a pretrained ``hf:`` folder
read shard by shard must give exactly what ``from_pretrained`` gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from training.models.build import build_for_training, build_model
from training.models.spec import ModelSpec

TOKENS = {"kind": "tokens", "task": "language_modeling", "features": ["tokens"], "vocab_size": 512, "seq_len": 16}

# A rank: build, shard, materialise, then rank 0 writes the whole state (gathered) to OUT.
WORKER = """
import json, sys, torch
from training.config.train_config import TrainConfig
from training.distributed import parallel
from training.models.build import build_for_training
from training.models.spec import ModelSpec
spec, strategy, out = ModelSpec.from_json(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3]
info = parallel.init(120)
cfg = TrainConfig(dataset_uri="unused", strategy=strategy, precision="fp32")
model, initial = build_for_training(spec, seed=11, strategy=strategy)
model, _ = parallel.parallelize(model, cfg, info, initial)
state = {k.removeprefix("module."): parallel.full_tensor(v).detach().cpu().clone() for k, v in model.state_dict().items()}
from torch.distributed.fsdp import FSDPModule
units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
if info.is_main:
    torch.save({"state": state, "fsdp_units": units}, out)
parallel.cleanup()
"""


def _initial_state(tmp_path: Path, spec: ModelSpec, *, ranks: int, strategy: str = "fsdp") -> dict[str, torch.Tensor]:
    return _initial_run(tmp_path, spec, ranks=ranks, strategy=strategy)["state"]


def _initial_run(tmp_path: Path, spec: ModelSpec, *, ranks: int, strategy: str = "fsdp") -> dict:
    """The whole state rank 0 gathered (``state``) and the modules FSDP2 wrapped (``fsdp_units``)."""
    script, out = tmp_path / "worker.py", tmp_path / f"state-{strategy}-{ranks}.pt"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script), json.dumps(spec.to_json()), strategy, str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_one_rank_and_two_ranks_start_bit_identical(tmp_path):
    # A vocabulary large enough (16,384 x 64 = 2**20 parameters) for the embedding and the head to be
    # units of their own (models.build.fsdp_layout), materialised after sharding like the blocks.
    spec = ModelSpec.for_data("transformer", {**TOKENS, "vocab_size": 16384}, hidden=64, depth=2)
    one, run = _initial_state(tmp_path, spec, ranks=1), _initial_run(tmp_path, spec, ranks=2)
    assert run["fsdp_units"] == ["", "tok", "blocks.0", "blocks.1", "head"]
    two = run["state"]
    assert _same(one, two) == []
    # DDP (the whole model per rank) starts from the same values too.
    assert _same(one, _initial_state(tmp_path, spec, ranks=2, strategy="ddp")) == []
    # The built-in decoder's own distributions: N(0, 0.02), residual projections scaled by depth, norms 1.
    assert abs(one["blocks.0.qkv.weight"].std().item() - 0.02) < 0.002
    assert abs(one["blocks.1.down.weight"].std().item() - 0.02 / 2) < 0.001
    assert abs(one["tok.weight"].std().item() - 0.02) < 0.001 and abs(one["head.weight"].std().item() - 0.02) < 0.001
    assert torch.equal(one["norm.weight"], torch.ones(64))
    # A different seed, different weights: the values are drawn, not fixed.
    other, initial = build_for_training(spec, seed=12, strategy="ddp")
    initial(other, torch.device("cpu"))
    assert not torch.equal(other.state_dict()["tok.weight"], one["tok.weight"])


def test_keyed_init_keeps_each_layers_own_distribution():
    """A model of torch layers (the MLP): each re-initialised by its own ``reset_parameters``."""
    meta = {"kind": "tabular", "task": "classification", "features": [f"f{i}" for i in range(64)], "n_classes": 3}
    spec = ModelSpec.for_data("mlp", meta, hidden=256, depth=1)
    model, initial = build_for_training(spec, seed=3, strategy="fsdp")
    assert all(p.is_meta for p in model.parameters())
    initial(model, torch.device("cpu"))
    w, b = model.net[0].weight, model.net[0].bias
    bound = 1 / 64 ** 0.5  # kaiming_uniform(a=sqrt(5)) and the bias's uniform: both within 1/sqrt(fan_in)
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound and b.abs().max() <= bound


@pytest.mark.slow
def test_pretrained_weights_read_shard_by_shard_equal_from_pretrained(tmp_path):
    from safetensors import safe_open

    from tests.hf_models import gpt2_folder

    folder = gpt2_folder(tmp_path / "gpt2", pretrain_steps=20)
    spec = ModelSpec.for_data(f"hf:{folder}", TOKENS, hidden=8, depth=1)
    reference = {k.removeprefix("model."): v for k, v in build_model(spec, pretrained=True).state_dict().items()}
    sharded = _initial_state(tmp_path, spec, ranks=2)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    read = [k for k in sharded if k.removeprefix("model.") in stored]
    assert len(read) == len(stored) > 10
    # Every parameter, the tied head too (the file holds it once, as its embedding).
    assert [k for k in sharded if not torch.equal(sharded[k], reference[k.removeprefix("model.")])] == []


def test_a_factory_parameter_no_rule_initialises_is_refused_naming_the_fix():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)
            self.scale = torch.nn.Parameter(torch.ones(3))  # set in the constructor only

        def forward(self, x):
            return self.linear(x) * self.scale

    from training.config.fields import ConfigError
    from training.models.materialize import InitialWeights, meta_parameters

    with meta_parameters():
        model = Scaled()
    with pytest.raises(ConfigError, match=r"config field 'model': parameter scale \(Scaled\) is given no initial "
                       r"value.*init_module\(name, module\)"):
        InitialWeights(model, seed=0)(model, torch.device("cpu"))

    class Initialised(Scaled):
        def init_module(self, name, m):
            if m is self:
                torch.nn.init.ones_(self.scale)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()

    with meta_parameters():
        model = Initialised()
    InitialWeights(model, seed=0)(model, torch.device("cpu"))
    assert torch.equal(model.scale, torch.ones(3)) and model.linear.weight.abs().max() <= 0.5
