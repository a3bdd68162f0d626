"""The memory preflight on the Airflow side, in the pre-launch check (``tasks.check_memory``, called
by ``check_model``): a CPU pod's ``k8s_memory_limit`` (the limit the rendered Job sets) split
between its ranks, and the local worker's memory split between ``world_size`` ranks, against the
estimate of a decoder on real token windows; refused with the fields to change, or passed."""

from __future__ import annotations

import pytest

from tests.plugins.test_kubernetes import k8s_params
from training.config.fields import ConfigError
from training.data.synthetic import make_markov_dataset
from training.metrics.memory import AGENT_CPU
from training.metrics import preflight
from training.metrics.preflight import local_budget
from training_airflow import tasks
from training_airflow.backends.kubernetes import spec as K
from training_airflow.run_config import train_config

pytestmark = pytest.mark.slow  # builds and counts decoders on fake tensors: about a minute


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    make_markov_dataset(root, n_train=32, n_val=8, vocab=4096, seq_len=64)
    return root


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))


def _check(params, tokens):
    params = {**params, "dataset_uri": str(tokens)}
    cfg = train_config(params, world_size=K.world_sizes(params)[0] if params["backend"] == "kubernetes" else None)
    tasks.check_model(params, cfg, None)


def test_a_cpu_pod_whose_limit_is_too_small_is_refused_before_launch(tokens):
    params = k8s_params(k8s_nnodes=2, k8s_gpus_per_node=0, model="transformer", hidden=512, depth=12, n_heads=8,
                        batch_size=8, strategy="ddp", k8s_memory_request="1Gi", k8s_memory_limit="1400Mi")
    with pytest.raises(ConfigError) as e:
        _check(params, tokens)
    msg = str(e.value)
    assert "the pod memory limit k8s_memory_limit" in msg and "1 rank)" in msg and "(checked before launch)" in msg
    assert "strategy=fsdp (estimate" in msg and e.value.field == "strategy"
    _check({**params, "strategy": "fsdp"}, tokens)  # state split over the two pods: fits
    _check({**params, "k8s_memory_limit": "8Gi"}, tokens)
    _check({**params, "k8s_gpus_per_node": 1}, tokens)  # GPU pods: the ranks check their device


def test_the_local_worker_splits_its_memory_between_world_size_ranks(tokens, monkeypatch):
    params = k8s_params(backend="local", world_size=2, model="transformer", hidden=64, depth=2, batch_size=8)
    _check(params, tokens)  # a small decoder fits this machine
    # The split itself on fixed figures: this machine's free memory moves while other jobs run.
    monkeypatch.setattr(preflight, "cgroup_memory", lambda: None)
    monkeypatch.setattr(preflight, "mem_available", lambda: 8 << 30)
    budget = local_budget(2, agent=AGENT_CPU)
    assert budget.used_by_others == AGENT_CPU and budget.per_rank == ((8 << 30) - AGENT_CPU) // 2
    assert local_budget(1).per_rank == 8 << 30
