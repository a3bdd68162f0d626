"""The trigger form's values become the trainer's config: evaluation during training and the
time-to-train target, with the cross-field rules the form cannot express refused by name."""

from __future__ import annotations

import pytest
from training.config.fields import ConfigError

from training_airflow.params import training_params
from training_airflow.run_config import train_config


def _form(**changes):
    values = {name: p.value for name, p in training_params().items()}
    return {**values, **changes}


def test_defaults_evaluate_during_training_without_a_target():
    cfg = train_config(_form())
    assert cfg.eval_every == 50
    assert cfg.target_metric == "none" and not cfg.has_target


def test_a_target_reaches_the_trainer():
    cfg = train_config(_form(eval_every=20, target_metric="eval/accuracy", target_value=0.8))
    assert (cfg.eval_every, cfg.target_metric, cfg.target_value) == (20, "eval/accuracy", 0.8)
    cfg = train_config(_form(target_metric="eval/loss", target_value=0.5))
    assert (cfg.target_metric, cfg.target_value) == ("eval/loss", 0.5)


@pytest.mark.parametrize("changes, field, fix", [
    ({"target_metric": "eval/accuracy", "target_value": None}, "target_value", "give the value to reach"),
    ({"target_metric": "eval/accuracy", "target_value": 80}, "target_value", ""),
    ({"target_metric": "eval/accuracy", "target_value": 0.8, "eval_every": 0}, "target_metric", "set eval_every"),
])
def test_inconsistent_target_is_refused_naming_the_field(changes, field, fix):
    with pytest.raises(ConfigError) as e:
        train_config(_form(**changes))
    assert f"config field '{field}'" in str(e.value)
    assert fix in str(e.value)


def test_a_worker_container_names_the_address_its_ranks_serve_metrics_on(monkeypatch):
    """TRAINING_METRICS_HOST (the compose worker's name, a pod's IP) replaces metrics_host's default for the
    local backend's ranks, so a Prometheus elsewhere can scrape them; a run that names an address keeps it."""
    from training_airflow import settings
    from training.config.train_config import TrainConfig

    default = TrainConfig.__dataclass_fields__["metrics_host"].default
    assert settings.local_metrics_host(default, default) == "127.0.0.1"
    monkeypatch.setenv("TRAINING_METRICS_HOST", "airflow-worker")
    assert settings.local_metrics_host(default, default) == "airflow-worker"
    assert settings.local_metrics_host("10.0.0.7", default) == "10.0.0.7"
