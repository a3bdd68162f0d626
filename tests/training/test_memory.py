"""The memory estimate's terms (training/metrics/memory.py) against what they stand for, the
budget read from a cgroup's files (v1 and v2), and the preflight's refusal naming the fields to
change (training/metrics/preflight.py). The estimate against measured peaks, under a real cgroup
limit: tests/training/test_memory_limit.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.metrics import memory, preflight
from training.models import activations
from training.models.build import build_model
from training.models.spec import ModelSpec

VOCAB, SEQ = 512, 64


def _spec(d_model: int = 128, layers: int = 4) -> ModelSpec:
    meta = {"kind": "tokens", "vocab_size": VOCAB, "seq_len": SEQ, "n_classes": VOCAB,
            "features": [f"t{i}" for i in range(SEQ + 1)], "label": None}
    return ModelSpec.for_data("transformer", meta, hidden=d_model, depth=layers, n_heads=4, dropout=0.0)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(dataset_uri="x", model="transformer", batch_size=8, **kw)


EXAMPLE = np.zeros(SEQ + 1, dtype=np.int64)


def _est(cfg: TrainConfig, world: int = 1, spec: ModelSpec | None = None) -> memory.Estimate:
    return memory.estimate(cfg, spec or _spec(), EXAMPLE, world_size=world, device="cpu", data_bytes=1000)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))


def test_parameters_gradients_and_adamw_state_are_sized_from_the_model_and_sharded_by_fsdp():
    model = build_model(_spec())
    n = sum(p.numel() for p in model.parameters())
    ddp = _est(_cfg(strategy="ddp"), world=2)
    assert ddp.terms["parameters"] == ddp.terms["gradients"] == 4 * n  # DDP: a full replica, bucket-held gradients
    assert ddp.terms["optimizer"] == 2 * 4 * n  # AdamW: exp_avg and exp_avg_sq in fp32
    assert ddp.terms["fsdp_units"] == ddp.terms["compression"] == 0
    psgd = _est(_cfg(strategy="ddp", comm_hook="powersgd"), world=2)
    assert psgd.terms["compression"] == 2 * 4 * n  # error feedback kept, and the bucket's copy while compressing
    fsdp = _est(_cfg(strategy="fsdp"), world=2)
    for k in ("parameters", "gradients", "optimizer"):
        assert fsdp.terms[k] == ddp.terms[k] // 2
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = n - block * len(model.blocks)  # embedding, final norm, head
    assert fsdp.setup["largest_unit_parameters"] == block and fsdp.setup["root_parameters"] == root
    assert fsdp.terms["fsdp_units"] == (memory.FSDP_UNITS_HELD * block + root) * 4 + (block + root) * 4
    assert fsdp.terms["data"] == 1000 and fsdp.terms["baseline"] == memory.BASELINE_CPU
    assert fsdp.total == sum(fsdp.terms.values())


def test_activations_are_counted_from_the_step_as_configured():
    none = _est(_cfg(activation_checkpointing="none"))
    full = _est(_cfg(activation_checkpointing="full"))
    half = _est(dataclasses.replace(_cfg(), batch_size=4))
    bf16 = _est(_cfg(precision="bf16"))
    # The step's peak is at least what autograd saves for backward (counted by another path).
    model = build_model(_spec())
    kept = activations.saved_bytes(model, torch.zeros(8, SEQ, dtype=torch.long))
    assert kept <= none.terms["activations"] <= 2 * kept
    assert full.terms["activations"] < 0.6 * none.terms["activations"]
    assert 0.4 < half.terms["activations"] / none.terms["activations"] < 0.6
    assert bf16.terms["activations"] < none.terms["activations"]
    assert none.terms["allocator"] == int(memory.ALLOCATOR_SHARE["cpu"] * none.terms["activations"])
    # Two ranks split the global batch: each rank's micro-batch, and its activations, halve.
    assert _est(_cfg(), world=2).terms["activations"] == half.terms["activations"]


def test_the_count_is_cached_per_model_and_step(monkeypatch):
    _est(_cfg())
    monkeypatch.setattr(memory, "count_step", lambda *a, **k: pytest.fail("counted again"))
    _est(_cfg())
    with pytest.raises(BaseException, match="counted again"):
        _est(_cfg(activation_checkpointing="full"))


def _budget(per_rank: int) -> preflight.Budget:
    return preflight.Budget(per_rank=per_rank, limit=per_rank * 2 + (1 << 28), used_by_others=1 << 28, ranks=2,
                            source="the memory limit of cgroup v1 /sys/fs/cgroup/memory/pod")


def test_a_run_that_cannot_fit_is_refused_naming_the_estimate_the_budget_and_what_fits():
    cfg = _cfg(strategy="ddp")
    spec = _spec(d_model=256, layers=4)

    def estimate_for(c, ws):
        return memory.estimate(c, spec, EXAMPLE, world_size=ws, device="cpu")

    est = estimate_for(cfg, 2)
    fsdp = estimate_for(dataclasses.replace(cfg, strategy="fsdp"), 2)
    assert fsdp.total < est.total
    budget = _budget((est.total + fsdp.total) // 2)  # fsdp fits, ddp does not
    with pytest.raises(ConfigError) as e:
        preflight.check(est, budget, cfg, 2, estimate_for=estimate_for)
    msg = str(e.value)
    assert e.value.field == "strategy"
    assert memory.gib(est.total) in msg and memory.gib(budget.per_rank) in msg
    assert "/sys/fs/cgroup/memory/pod" in msg and "2 ranks" in msg
    assert f"strategy=fsdp (estimate {memory.gib(fsdp.total)})" in msg
    for lever in ("strategy=fsdp", "world_size", "activation_checkpointing=full", "batch_size"):
        assert lever in msg
    for term in ("parameters", "gradients", "optimizer", "activations", "baseline"):
        assert term in msg
    preflight.check(fsdp, budget, dataclasses.replace(cfg, strategy="fsdp"), 2, estimate_for=estimate_for)  # fits


def test_activation_checkpointing_is_proposed_when_it_is_what_fits():
    cfg = _cfg(strategy="fsdp")
    spec = _spec(d_model=64, layers=6)

    def estimate_for(c, ws):
        return memory.estimate(c, spec, EXAMPLE, world_size=ws, device="cpu", baseline=0)

    none = estimate_for(cfg, 1)
    full = estimate_for(dataclasses.replace(cfg, activation_checkpointing="full"), 1)
    with pytest.raises(ConfigError) as e:
        preflight.check(none, _budget((none.total + full.total) // 2), cfg, 1, estimate_for=estimate_for)
    assert e.value.field == "activation_checkpointing"
    assert f"activation_checkpointing=full (estimate {memory.gib(full.total)})" in str(e.value)


def test_the_budget_is_the_cgroup_limit_less_what_others_use(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/pod/a\n0::/\n")
    group = tmp_path / "memory" / "pod" / "a"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(3 << 30))
    (group / "memory.usage_in_bytes").write_text(str(1 << 30))
    (group / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {1 << 28}\n")
    (tmp_path / "memory" / "pod" / "memory.limit_in_bytes").write_text(str(8 << 30))  # a looser parent
    (tmp_path / "memory" / "pod" / "memory.usage_in_bytes").write_text("0")
    limit, working, where = preflight.cgroup_memory(proc, tmp_path)
    assert (limit, working) == (3 << 30, (1 << 30) - (1 << 28)) and where.endswith("memory/pod/a")
    assert where.startswith("cgroup v1")

    proc.write_text("0::/pod\n")  # v2 alone
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "pod").mkdir()
    (tmp_path / "pod" / "memory.max").write_text(str(2 << 30))
    (tmp_path / "pod" / "memory.current").write_text(str(1 << 29))
    (tmp_path / "pod" / "memory.stat").write_text("inactive_file 0\n")
    assert preflight.cgroup_memory(proc, tmp_path)[:2] == (2 << 30, 1 << 29)
    (tmp_path / "pod" / "memory.max").write_text("max\n")
    assert preflight.cgroup_memory(proc, tmp_path) is None


def test_a_pod_budget_is_its_limit_less_the_agent_per_rank():
    b = preflight.pod_budget(8 << 30, 4)
    assert b.per_rank == ((8 << 30) - memory.AGENT_CPU) // 4 and "k8s_memory_limit" in b.describe()


def test_tame_malloc_sets_glibc_thresholds():
    assert memory.tame_malloc() is True
