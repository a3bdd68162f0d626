"""The registry gate, for real: MLflow's model registry on the test SQLite store, models exported
exactly as the trainer exports them (safetensors + model_config.json) and scored on real data.

A person then finds the champion the way they would in MLflow: by alias, to its source run."""

import json

import mlflow
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient
from safetensors.torch import save_file

from training.results import registry
from training.data.dataset import load_split
from training.data.synthetic import make_teacher_dataset, read_meta
from training.evaluate import example_inputs, score_folder
from training.models.build import build_model
from training.models.spec import ModelSpec
from training.tracking.run import RunLogger, open_run
from training.data.gate import fingerprint


def _export(folder, dataset, *, seed: int, train_steps: int):
    """A model folder as the trainer writes it; ``train_steps=0`` leaves the random init."""
    torch.manual_seed(seed)
    spec = ModelSpec.for_data("mlp", read_meta(dataset), hidden=32, depth=2)
    model = build_model(spec)
    if train_steps:
        data = load_split(dataset, "train")
        x, y = torch.from_numpy(data.features), torch.from_numpy(data.labels)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for i in range(train_steps):
            idx = torch.randint(0, len(y), (256,))
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "model_config.json").write_text(json.dumps(spec.to_json()))
    return folder


def _gate(name, folder, dataset, *, dag_run_id, margin=0.005):
    run_id = open_run(name, dag_id="distributed_training", dag_run_id=dag_run_id)
    accuracy = score_folder(folder, str(dataset))["eval/accuracy"]
    RunLogger(run_id).log_metrics({"eval/accuracy": accuracy}, step=100)
    result = registry.register_and_gate(
        run_id=run_id, model_dir=folder, registered_model=name, metric_value=accuracy, margin=margin,
        example_inputs=example_inputs(str(dataset)), step=100, data_fingerprint=fingerprint(dataset),
        score_model=lambda f: score_folder(f, str(dataset))["eval/accuracy"])
    return run_id, accuracy, result


def test_decide_applies_the_margin():
    assert registry.decide(0.80, None, 0.005)[0] == "champion"
    assert registry.decide(0.81, 0.80, 0.005)[0] == "champion"
    decision, reason = registry.decide(0.804, 0.80, 0.005)
    assert decision == "challenger" and "margin 0.005" in reason and "+0.0040" in reason
    assert registry.decide(0.80, 0.80, 0.0)[0] == "challenger", "a tie does not take the alias"


def test_the_gate_compares_on_the_tasks_metric_in_its_direction():
    from training.config.fields import ConfigError

    assert registry.gate_metric("auto", "classification") == "eval/accuracy"
    assert registry.gate_metric("auto", "regression") == "eval/r2"
    assert registry.gate_metric("eval/loss", "regression") == "eval/loss"
    with pytest.raises(ConfigError, match="'gate_metric': eval/accuracy is not measured for regression"):
        registry.gate_metric("eval/accuracy", "regression")
    # R² rises, an RMSE falls; either must move by more than the margin.
    assert registry.decide(0.70, 0.60, 0.05, "eval/r2")[0] == "champion"
    assert registry.decide(0.62, 0.60, 0.05, "eval/r2")[0] == "challenger"
    decision, reason = registry.decide(40.0, 50.0, 5.0, "eval/rmse")
    assert decision == "champion" and reason.startswith("eval/rmse 40.0000 beats the champion's 50.0000")
    assert registry.decide(47.0, 50.0, 5.0, "eval/rmse")[0] == "challenger"
    assert registry.decide(55.0, 50.0, 0.0, "eval/rmse")[0] == "challenger"


@pytest.mark.slow
def test_champion_and_challenger(dataset, tmp_path):
    name = "gate-test"
    client = MlflowClient()
    weak = _export(tmp_path / "weak", dataset, seed=1, train_steps=0)
    strong = _export(tmp_path / "strong", dataset, seed=2, train_steps=300)

    # 1. The first model becomes the champion, whatever it scores.
    weak_run, weak_acc, first = _gate(name, weak, dataset, dag_run_id="manual__1")
    assert (first["decision"], first["version"]) == ("champion", "1")
    assert "first model" in first["reason"]

    # 2. A clearly better model takes the alias; the run and the version say why.
    strong_run, strong_acc, second = _gate(name, strong, dataset, dag_run_id="manual__2")
    assert strong_acc > weak_acc + 0.2, (strong_acc, weak_acc)
    assert (second["decision"], second["version"], second["previous_champion"]) == ("champion", "2", "1")
    tags = client.get_run(strong_run).data.tags
    assert tags["registry.decision"] == "champion" and "beats the champion's" in tags["registry.reason"]

    # 3. New data lands; a weak model trained on it is compared with the champion re-scored on
    #    the same new validation rows, loses, and stays a challenger.
    new_data = tmp_path / "new-data"
    make_teacher_dataset(new_data, n_train=2_000, n_val=1_000, seed=0, label_noise=0.2)
    weak2 = _export(tmp_path / "weak2", new_data, seed=3, train_steps=0)
    weak2_run, weak2_acc, third = _gate(name, weak2, new_data, dag_run_id="manual__3")
    assert third["decision"] == "challenger"
    champion_on_new = score_folder(strong, str(new_data))["eval/accuracy"]
    assert f"champion's {champion_on_new:.4f}" in third["reason"] and "re-scored" in third["reason"]
    run3 = client.get_run(weak2_run)
    assert run3.data.tags["registry.decision"] == "challenger"
    assert "does not beat" in run3.data.tags["registry.reason"]
    assert run3.data.tags["registry.aliases"].startswith(f"champion v2 (eval/accuracy {strong_acc:.4f}); challenger v")

    # A retried evaluate task registers nothing new and keeps the decision.
    again = registry.register_and_gate(
        run_id=weak2_run, model_dir=weak2, registered_model=name, metric_value=weak2_acc, margin=0.005,
        example_inputs=example_inputs(str(new_data)), step=100)
    assert (again["version"], again["decision"]) == ("3", "challenger")
    assert len(client.search_model_versions(f"name = '{name}'")) == 3

    # What a person does in MLflow: find the champion, its source run and its figures, load it.
    champion = client.get_model_version_by_alias(name, "champion")
    assert str(champion.version) == "2" and champion.run_id == strong_run
    assert client.get_run(champion.run_id).data.metrics["eval/accuracy"] == pytest.approx(strong_acc)
    # The challenger is the better of the two models that are not the champion.
    best_other = weak2_run if weak2_acc >= weak_acc else weak_run
    assert client.get_model_version_by_alias(name, "challenger").run_id == best_other
    loaded = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    inputs = loaded.metadata.get_input_schema().inputs[0]
    assert inputs.shape == (-1, 16) and inputs.type == np.dtype("float32")
    val = load_split(dataset, "validation")
    predicted = np.asarray(loaded.predict(val.features)).argmax(axis=1)
    assert (predicted == val.labels).mean() == pytest.approx(strong_acc, abs=1e-6), "the registered model is the scored one"


def test_challenger_is_the_best_version_that_is_not_the_champion(tmp_path):
    """Not whichever model lost last: a smoke test far below the runner-up leaves the alias alone,
    and a dethroned champion becomes the challenger when it is the best of the rest."""
    client, name = MlflowClient(), "challenger-rule"
    client.create_registered_model(name)

    def version(accuracy: float) -> str:
        return str(client.create_model_version(name, source=(tmp_path / "m").as_uri(),
                                               tags={"eval/accuracy": str(accuracy)}).version)

    def alias(which: str) -> str:
        return str(client.get_model_version_by_alias(name, which).version)

    first = version(0.90)
    client.set_registered_model_alias(name, "champion", first)
    assert registry.update_challenger(client, name) == "champion v1 (eval/accuracy 0.9000)"
    runner_up = version(0.85)
    assert registry.update_challenger(client, name) == ("champion v1 (eval/accuracy 0.9000); "
                                                         "challenger v2 (eval/accuracy 0.8500)")
    version(0.40)  # a 20-step smoke test loses later
    registry.update_challenger(client, name)
    assert alias("challenger") == runner_up
    best = version(0.95)
    client.set_registered_model_alias(name, "champion", best)
    registry.update_challenger(client, name)
    assert (alias("champion"), alias("challenger")) == (best, first)
