"""Names in a run's conf that are not Params of the DAG are refused before the run starts, with one
message (training_airflow/conf_check.py): by ``scripts/demo.py --set``, by the api-server's
middleware (here with a stand-in app; against the live api-server: tests/e2e/test_live_conf.py),
and by the first task, ``open_run``, for runs made past the api-server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT
from training.config.fields import ConfigError
from training_airflow.conf_check import ConfCheck, unknown_fields_error

KNOWN = ["steps", "world_size", "label_column", "dataset_uri", "lr"]


def test_the_message_names_the_key_the_closest_param_and_the_fix():
    error = unknown_fields_error({"steps": 5, "step": 600}, KNOWN, dag_id="distributed_training")
    assert isinstance(error, ConfigError) and error.field == "step"
    assert str(error) == (
        "config field 'step': is not a Param of distributed_training (did you mean 'steps'?), so a run would "
        "ignore its value and start with the default. Fix: write 'steps' if that is what you meant, or leave "
        "'step' out (the Params are the fields of the DAG's trigger form)")


def test_every_unknown_key_is_named_and_one_far_from_any_param_says_so():
    message = str(unknown_fields_error({"world_sise": 1, "zzz": 2}, KNOWN, dag_id="d"))
    assert "'world_sise': is not a Param of d (did you mean 'world_size'?)" in message
    assert "nor is 'zzz' (no Param is close to it)" in message and "leave 'zzz' out" in message


def test_known_keys_and_no_conf_pass():
    assert unknown_fields_error({"steps": 5, "lr": 0.1}, KNOWN, dag_id="d") is None
    assert unknown_fields_error(None, KNOWN, dag_id="d") is None
    assert unknown_fields_error({}, KNOWN, dag_id="d") is None


# --------------------------------------------------------------------------- the middleware


def _request(check: ConfCheck, path: str, body: bytes, method: str = "POST") -> tuple[int | None, bytes, list]:
    """One HTTP request through ``check``; what came back, and what reached the app behind it."""
    sent, reached = [], []
    chunks = [{"type": "http.request", "body": body[:7], "more_body": True},
              {"type": "http.request", "body": body[7:], "more_body": False}]

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        got = b""
        while True:
            message = await receive()
            got += message.get("body", b"")
            if not message.get("more_body"):
                break
        reached.append(got)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    check.app = app
    asyncio.run(check({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), reached


def _check(*, allowed: bool = True) -> ConfCheck:
    async def authorized(scope, dag_id):
        return allowed

    return ConfCheck(None, declared=lambda app, dag_id: KNOWN if dag_id != "gone" else None, authorized=authorized)


TRIGGER = "/api/v2/dags/distributed_training/dagRuns"


def test_a_trigger_naming_an_unknown_key_gets_400_and_never_reaches_airflow():
    status, body, reached = _request(_check(), TRIGGER, json.dumps({"logical_date": None, "conf": {"step": 600}}).encode())
    assert status == 400 and reached == []
    assert json.loads(body)["detail"].startswith("config field 'step': is not a Param of distributed_training "
                                                 "(did you mean 'steps'?)")


def test_everything_else_passes_through_untouched():
    good = json.dumps({"conf": {"steps": 600}}).encode()
    unknown = json.dumps({"conf": {"step": 600}}).encode()
    for check, path, body, method in (
            (_check(), TRIGGER, good, "POST"),  # only Params
            (_check(), TRIGGER + "/", b"not json", "POST"),  # Airflow answers 422 itself
            (_check(), "/api/v2/dags/someone_elses_dag/dagRuns", unknown, "POST"),  # not a DAG of this project
            (_check(), "/api/v2/dags/distributed_training/dagRuns/list", unknown, "POST"),
            (_check(), TRIGGER, unknown, "GET"),
            (_check(allowed=False), TRIGGER, unknown, "POST"),  # Airflow answers 401/403 itself
    ):
        status, _, reached = _request(check, path, body, method)
        assert (status, reached) == (200, [body]), (path, method, body)


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_the_plugin_registers_the_middleware():
    code = ("import json, sys; sys.path.insert(0, 'plugins'); import training_links as p; "
            "print(json.dumps([m['middleware'].__name__ for m in p.TrainingLinks.fastapi_root_middlewares]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["ConfCheck"]


# --------------------------------------------------------------------------- the demo and open_run


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_the_demo_refuses_an_unknown_set_before_anything_runs(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "TRAINING_VAR_DIR": str(tmp_path / "var")}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--set", "step=600"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "demo.py: --set: config field 'step': is not a Param of distributed_training (did you mean 'steps'?)" \
           in out.stderr
    assert "==>" not in out.stdout  # no set-up step started
    assert not (tmp_path / "airflow" / "airflow.db").exists() and not (tmp_path / "var").exists()


def test_open_run_refuses_a_conf_key_that_is_no_param_before_any_other_check(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from training_airflow import settings, tasks

    monkeypatch.setattr(settings, "ensure_tracking_uri", lambda: pytest.fail("open_run went past the conf check"))
    # In a task the Params hold every Param and the unknown key too: the run's conf tells them apart.
    params = {"steps": 300, "world_size": 2, "step": 600}
    dag_run = SimpleNamespace(conf={"step": 600}, run_id="manual__x")
    with pytest.raises(AirflowFailException) as failed:  # fails_fast: no retry
        tasks.open_run(params, dag_id="distributed_training", dag_run_id="manual__x", dag_run=dag_run)
    assert str(failed.value).startswith("invalid run parameters: config field 'step': is not a Param of "
                                        "distributed_training (did you mean 'steps'?)")


# --------------------------------------------------------------------------- a target that fits the task


def test_a_trigger_whose_target_the_task_cannot_log_gets_400():
    async def authorized(scope, dag_id):
        return True

    defaults = {"target_metric": "eval/accuracy", "target_value": 0.8, "text_column": "", "task": "auto"}
    check = ConfCheck(None, declared=lambda app, dag_id: defaults, authorized=authorized)
    status, body, reached = _request(check, TRIGGER, json.dumps({"conf": {"task": "regression"}}).encode())
    assert (status, reached) == (400, []), body
    assert json.loads(body)["detail"].startswith("config field 'target_metric': eval/accuracy is measured for "
                                                 "classification only, but task is regression")
    for conf in ({"text_column": "text"}, {"task": "regression", "target_metric": "eval/r2"}):
        status, _, reached = _request(check, TRIGGER, json.dumps({"conf": conf}).encode())
        assert status == 200 and len(reached) == 1, conf


def _text_table(root, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    pq.write_table(pa.table(columns), root / "docs.parquet")
    return root


def test_open_run_refuses_accuracy_on_text_without_a_label_before_the_gate(tmp_path):
    """No dataset.json: one Parquet file's schema says text without a label, i.e. a language model."""
    from training_airflow.params import training_params
    from training_airflow.run_config import train_config

    params = {k: p.value for k, p in training_params().items()}
    lm = _text_table(tmp_path / "lm", {"text": ["a document", "another one"]})
    with pytest.raises(ConfigError) as err:
        train_config({**params, "dataset_uri": str(lm), "text_column": "text", "model": "transformer",
                      "target_metric": "eval/accuracy", "target_value": 0.8})
    assert err.value.field == "target_metric"
    assert "eval/accuracy is measured for classification only, but the data trains language modeling" in str(err.value)
    cfg = train_config({**params, "dataset_uri": str(lm), "text_column": "text", "model": "transformer",
                        "target_metric": "eval/bits_per_byte", "target_value": 2.5})
    assert cfg.target_metric == "eval/bits_per_byte"
    labelled = _text_table(tmp_path / "cls", {"text": ["good", "bad"], "label": [1, 0]})
    train_config({**params, "dataset_uri": str(labelled), "text_column": "text", "model": "transformer",
                  "target_metric": "eval/accuracy", "target_value": 0.8})


def test_the_demo_asks_for_accuracy_only_on_its_own_classification_table(monkeypatch):
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # demo.py imports project_env beside it

    spec = importlib.util.spec_from_file_location("demo_script", ROOT / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.run_conf([])["target_metric"] == "eval/accuracy"
    assert demo.run_conf(["steps=50"]) == {**demo.DEMO_CONF, "steps": 50}
    text = demo.run_conf(["dataset_uri=var/data/python-help", "text_column=text", "model=transformer"])
    assert "target_metric" not in text and text["model"] == "transformer"
    assert demo.run_conf(["dataset_uri=/d", "target_metric=eval/r2", "target_value=0.5"])["target_metric"] == "eval/r2"
    with pytest.raises(ValueError, match="has no '='"):
        demo.run_conf(["steps"])


def test_a_sweep_whose_search_the_trainer_refuses_gets_400_before_any_run(tmp_path):
    from training_airflow.sweep_tasks import sweep_params

    async def authorized(scope, dag_id):
        return True

    defaults = {name: p.value for name, p in sweep_params().items()} | {"dataset_uri": str(tmp_path)}
    check = ConfCheck(None, declared=lambda app, dag_id: defaults, authorized=authorized)
    path = "/api/v2/dags/training_sweep/dagRuns"
    for conf, says in (({"search_space": {"hiden": [32, 64]}}, "config field 'search_space.hiden': is not a field"),
                       ({"search_space": {"lr": {"low": 0.1, "high": 0.01}}},
                        "config field 'search_space.lr': low=0.1 is not below high=0.01"),
                       ({"max_parallel_trials": 9}, "config field 'max_parallel_trials': 9 is not between 1 and "
                                                    "trials=6")):
        status, body, reached = _request(check, path, json.dumps({"conf": conf}).encode())
        assert (status, reached) == (400, []), body
        assert json.loads(body)["detail"].startswith(says), body
    status, _, reached = _request(check, path, json.dumps({"conf": {"trials": 8}}).encode())
    assert status == 200 and len(reached) == 1
