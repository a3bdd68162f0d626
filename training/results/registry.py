"""Log a trained model to MLflow, register it, and gate the ``champion`` alias on its evaluation.

    version = register_and_gate(run_id=RUN, model_dir="step_00000300/", registered_model="demo",
                                metric_value=0.81, margin=0.005, example_inputs=x[:5], step=300)

The exported model (``model.safetensors`` + ``model_config.json``) is logged to the run
(``training.results.logged_model``: ``pt2``, or pyfunc from code around the folder) and
registered as a version of ``registered_model``. It becomes ``champion`` when its gate
metric beats the champion's by more than ``margin``; ``challenger`` names the best other version.
The decision and reason are tagged on version and run (``registry.*``). Retries are idempotent;
gates of one registered model must run one at a time. Why: docs/decisions/0005-champion-gate-and-challenger.md.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
GATE_METRIC = "eval/accuracy"
DEFAULT_GATE_METRIC = {"classification": "eval/accuracy", "regression": "eval/r2",
                       "language_modeling": "eval/bits_per_byte"}  # comparable across tokenizers
TAG_DECISION = "registry.decision"
TAG_REASON = "registry.reason"
TAG_ALIASES = "registry.aliases"


def _client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def _existing_version(client, name: str, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException:
        return None
    return max(found, key=lambda v: int(v.version)) if found else None


def _champion(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:  # no registered model yet, or no alias
        return None


def exported_folder(downloaded: str | Path) -> Path:
    """The exported folder inside a downloaded registered model (the pt2 model's extra files, or a
    pyfunc model's artifact)."""
    from training.checkpoint.export import MODEL_CONFIG_FILE

    found = sorted(Path(downloaded).glob(f"*/**/{MODEL_CONFIG_FILE}"))
    if not found:
        raise FileNotFoundError(f"no {MODEL_CONFIG_FILE} in the registered model at {downloaded}")
    return found[0].parent


def gate_metric(choice: str, task: str) -> str:
    """The metric the gate compares for a run of ``task``: ``choice``, or the task's default for
    ``auto``. A metric the task does not log is refused (ConfigError naming ``gate_metric``)."""
    from training.config.fields import ConfigError
    from training.config.train_config import metric_task

    if choice in ("auto", "", None):
        return DEFAULT_GATE_METRIC.get(task, GATE_METRIC)
    if metric_task(choice) not in (None, task):
        raise ConfigError("gate_metric", f"{choice} is not measured for {task}",
                          f"use auto ({DEFAULT_GATE_METRIC.get(task, GATE_METRIC)} for {task}) or eval/loss")
    return choice


def decide(value: float, champion_value: float | None, margin: float, metric: str = GATE_METRIC) -> tuple[str, str]:
    """The gate itself: (decision, reason). Accuracy and R² must rise by more than ``margin``, a
    loss or an RMSE fall by more than it."""
    from training.config.train_config import higher_is_better

    if champion_value is None:
        return CHAMPION, f"first model with {metric}: {value:.4f} becomes the champion"
    gain = value - champion_value if higher_is_better(metric) else champion_value - value
    if gain > margin:
        return CHAMPION, (f"{metric} {value:.4f} beats the champion's {champion_value:.4f} "
                          f"by {value - champion_value:+.4f} (> margin {margin:g})")
    return CHALLENGER, (f"{metric} {value:.4f} does not beat the champion's {champion_value:.4f} "
                        f"by more than the margin {margin:g} (difference {value - champion_value:+.4f})")


def adapter_tags(model_dir: str | Path) -> dict[str, str]:
    """An adapted model's version tags: the adapter and the base model it was trained on (its ``hf:``
    folder and the sha256 of its weights), from the export's ``model_config.json``."""
    from training.checkpoint.export import read_spec

    adapter = read_spec(model_dir).arch.get("adapter")
    if not adapter:
        return {}
    base = adapter.get("base") or {}
    return {"adapter": str(adapter["type"]), "adapter.r": str(adapter["r"]), "adapter.base_model": str(base.get("model", "")),
            "adapter.base_sha256": str(base.get("sha256", ""))}


def register_and_gate(*, run_id: str, model_dir: str | Path, registered_model: str, metric_value: float,
                      margin: float, example_inputs, step: int, data_fingerprint: str | None = None,
                      score_model: Callable[[Path], float] | None = None, metric: str = GATE_METRIC,
                      flavour: str = "auto", pt2_bound: int | None = None) -> dict[str, Any]:
    """Log + register the model of ``run_id`` (once), then apply the champion gate (once).

    ``flavour``, ``pt2_bound``: how it is logged (``logged_model.choose_flavour``); the choice and
    its reason are tagged on the run and the version (``registry.flavour``...).

    ``metric``: what the gate compares (``metric_value`` is the candidate's). ``score_model(folder)``
    gives that metric for a model folder (``model.safetensors`` + ``model_config.json``) on the
    candidate's validation split. When the champion was evaluated on other data (its
    ``data.fingerprint`` differs), it is re-scored with it so both numbers come from the same rows.
    """
    import mlflow
    from mlflow.entities import RunTag

    client = _client()
    version = _existing_version(client, registered_model, run_id)
    if version is None:
        from training.results.logged_model import choose_flavour, log_model

        chosen = choose_flavour(model_dir, flavour, bound=pt2_bound)
        log.info("registry: logging the model as %s: %s", chosen.name, chosen.reason)
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in chosen.tags().items()])
        info = log_model(run_id, model_dir, example_inputs=example_inputs, step=step, flavour=chosen)
        tags = {metric: f"{metric_value:.6f}", "step": str(step), **chosen.tags()}
        if data_fingerprint:
            tags["data.fingerprint"] = data_fingerprint
        tags.update(adapter_tags(model_dir))
        version = mlflow.register_model(info.model_uri, registered_model, tags=tags)
    if version.tags.get(TAG_DECISION):  # a retry after the decision was made: keep it
        return _result(registered_model, version, version.tags[TAG_DECISION], version.tags.get(TAG_REASON, ""), None)

    champion = _champion(client, registered_model)
    if champion is not None and str(champion.version) == str(version.version):  # alias set, then the task died
        return _record(client, registered_model, version, run_id, CHAMPION, "already the champion", None, metric)
    champion_value, basis = None, ""
    if champion is not None:
        champion_value, basis = _champion_value(client, registered_model, champion, data_fingerprint, score_model,
                                                metric)
    if champion is not None and champion_value is None:
        decision, reason = CHAMPION, f"the champion has no recorded {metric} to compare with"
    else:
        decision, reason = decide(metric_value, champion_value, margin, metric)
    if champion is not None:
        reason += f" (champion: version {champion.version} from run {champion.run_id}{basis})"
    if decision == CHAMPION:
        client.set_registered_model_alias(registered_model, CHAMPION, version.version)
    return _record(client, registered_model, version, run_id, decision, reason,
                   str(champion.version) if champion is not None else None, metric)


def update_challenger(client, name: str, metric: str = GATE_METRIC) -> str:
    """Point ``challenger`` at the best version that is not the champion (by the recorded gate
    ``metric``, lower first for a loss or an RMSE; ties: the newer version), or remove it when there
    is none. Returns both aliases as a line for people:
    ``champion v3 (eval/accuracy 0.8123); challenger v2 (eval/accuracy 0.7990)``."""
    from mlflow.exceptions import MlflowException

    champion = _champion(client, name)
    best, best_value = None, None
    from training.config.train_config import higher_is_better

    sign = 1.0 if higher_is_better(metric) else -1.0
    for v in client.search_model_versions(f"name = '{name}'"):
        value = _recorded_metric(client, v, metric)
        if value is None or (champion is not None and str(v.version) == str(champion.version)):
            continue
        if best is None or (sign * value, int(v.version)) > (sign * best_value, int(best.version)):
            best, best_value = v, value
    if best is not None:
        client.set_registered_model_alias(name, CHALLENGER, best.version)
    else:
        with contextlib.suppress(MlflowException):
            client.delete_registered_model_alias(name, CHALLENGER)
    parts = []
    if champion is not None:
        value = _recorded_metric(client, champion, metric)
        parts.append(f"champion v{champion.version}" + (f" ({metric} {value:.4f})" if value is not None else ""))
    if best is not None:
        parts.append(f"challenger v{best.version} ({metric} {best_value:.4f})")
    return "; ".join(parts) or "none"


def _champion_value(client, name: str, champion, data_fingerprint: str | None,
                    score_model: Callable[[Path], float] | None, metric: str) -> tuple[float | None, str]:
    recorded = _recorded_metric(client, champion, metric)
    same_data = data_fingerprint is None or champion.tags.get("data.fingerprint") == data_fingerprint
    if same_data or score_model is None:
        return recorded, ("" if same_data else ", evaluated on other data")
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(f"models:/{name}/{champion.version}", dst_path=tmp)
        try:
            value = float(score_model(exported_folder(local)))
        except Exception as e:  # e.g. the champion expects other features: compare recorded values
            log.warning("could not re-score champion version %s on this data (%s); using its recorded %s",
                        champion.version, e, metric)
            return recorded, f", evaluated on other data; re-scoring failed: {e}"
    return value, f", re-scored on this run's validation data (recorded {recorded})"


def _recorded_metric(client, version, metric: str) -> float | None:
    """The gate metric recorded on a version, else its run's metric."""
    if metric in version.tags:
        return float(version.tags[metric])
    if version.run_id:
        return client.get_run(version.run_id).data.metrics.get(metric)
    return None


def _record(client, name: str, version, run_id: str, decision: str, reason: str, previous: str | None,
            metric: str = GATE_METRIC) -> dict[str, Any]:
    from mlflow.entities import RunTag

    client.set_model_version_tag(name, version.version, TAG_DECISION, decision)
    client.set_model_version_tag(name, version.version, TAG_REASON, reason)
    client.update_model_version(name, version.version, description=f"{decision}: {reason}")
    aliases = update_challenger(client, name, metric)
    client.log_batch(run_id, tags=[RunTag(TAG_DECISION, decision), RunTag(TAG_REASON, reason),
                                   RunTag("registry.model", name), RunTag("registry.version", str(version.version)),
                                   RunTag(TAG_ALIASES, aliases)])
    return _result(name, version, decision, reason, previous)


def _result(name: str, version, decision: str, reason: str, previous: str | None) -> dict[str, Any]:
    return {"registered_model": name, "version": str(version.version), "decision": decision, "reason": reason,
            "previous_champion": previous, "model_uri": f"models:/{name}/{version.version}"}
