"""The trigger forms and schedules, as Airflow parses them from dags/.

Every Param of every DAG is checked for what the web form needs (whatever Params exist now or are
added later): a title, a description, a JSON-schema type, bounds on numbers, a default that passes
its own schema, and a nullable type where the default is empty (the form sends an empty field as
null, so an empty non-nullable default would block the Trigger button). Then the schedules:
the default cron, `TRAINING_SCHEDULE`, and the Asset that links register_dataset to retraining.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXED_CHOICES = ("strategy", "precision", "comm_hook", "backend", "runtime", "task", "gate_metric")

def summarize(dag_folder: str) -> dict:
    """What these tests check of each DAG Airflow parses from ``dag_folder``, as JSON would carry it."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=dag_folder)
    out = {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": {}}
    for dag_id, dag in bag.dags.items():
        params = {}
        for name in dag.params:
            p = dag.params.get_param(name)
            try:
                p.resolve(suppress_exception=False)
                error = None
            except Exception as e:
                error = str(e)
            params[name] = {"schema": p.schema, "description": p.description, "default": p.value, "error": error}
        cond = getattr(dag.timetable, "asset_condition", None)
        out["dags"][dag_id] = {
            "params": params, "timetable": type(dag.timetable).__name__,
            "summary": getattr(dag.timetable, "expression", None),
            "catchup": dag.catchup, "max_active_runs": dag.max_active_runs,
            "schedule_assets": sorted(a.name for a in getattr(cond, "objects", ())),
            "outlets": sorted(o.name for t in dag.tasks for o in t.outlets),
        }
    return json.loads(json.dumps(out, default=str))


# A fresh interpreter for the tests that change the environment the DAG files read when parsed.
PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from tests.dags.test_forms import summarize
print(json.dumps(summarize(sys.argv[1])))
"""


def parse_dags(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "dags"), str(ROOT)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parsed() -> dict:
    """The DAG folder parsed in this process, under the environment the suite runs with."""
    result = summarize(str(ROOT / "dags"))
    assert result["errors"] == {}
    return result


def test_every_param_renders_as_a_clear_form_field(parsed):
    checked = 0
    for dag_id, dag in parsed["dags"].items():
        for name, p in dag["params"].items():
            where, schema = f"{dag_id}.{name}", p["schema"]
            types = schema.get("type")
            types = types if isinstance(types, list) else [types]
            assert types != [None], f"{where}: no JSON-schema type"
            assert schema.get("title"), f"{where}: no title"
            assert p["description"] and len(p["description"]) >= 15, f"{where}: no description that explains it"
            assert p["error"] is None, f"{where}: default {p['default']!r} fails its own schema: {p['error']}"
            if {"integer", "number"} & set(types):
                assert "minimum" in schema or "exclusiveMinimum" in schema, f"{where}: a number needs a lower bound"
            if p["default"] in ("", None):
                assert "null" in types, (f"{where}: empty default but not nullable; the form sends an empty "
                                         "field as null and would refuse to trigger with the defaults")
            if "enum" in schema:
                assert p["default"] in schema["enum"], where
            if name in FIXED_CHOICES:
                assert "enum" in schema, f"{where}: fixed choices belong in an enum (a dropdown in the form)"
            checked += 1
    assert checked >= 20


def test_model_suggests_the_built_ins_and_takes_a_factory_path(parsed):
    """A string field with `examples`: Airflow's form renders a text input with the examples as a
    datalist (suggestions), so a user can pick a built-in or type package.module:function."""
    p = parsed["dags"]["distributed_training"]["params"]["model"]
    schema = p["schema"]
    assert schema["examples"] == ["mlp", "cnn", "transformer"] and "enum" not in schema
    assert p["default"] == "mlp"
    for ok in ("mlp", "transformer", "resmlp:residual_mlp", "my_team.models.tabular:build"):
        assert re.match(schema["pattern"], ok), ok
    for bad in ("resnet", "my_team.models", "a:b:c", "os.system('x'):y", ""):
        assert not re.match(schema["pattern"], bad), bad


def test_both_training_dags_share_one_form(parsed):
    dags = parsed["dags"]
    assert dags["distributed_training"]["params"] == dags["distributed_training_on_data"]["params"]


def test_default_schedule_is_nightly_without_catchup(parsed):
    dag = parsed["dags"]["distributed_training"]
    assert (dag["timetable"], dag["summary"]) == ("CronTriggerTimetable", "0 3 * * *")
    assert dag["catchup"] is False and dag["max_active_runs"] == 1


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_schedule_follows_training_schedule():
    dags = parse_dags(TRAINING_SCHEDULE="*/30 6-18 * * 1-5")["dags"]
    assert dags["distributed_training"]["summary"] == "*/30 6-18 * * 1-5"
    assert parse_dags(TRAINING_SCHEDULE="none")["dags"]["distributed_training"]["timetable"] == "NullTimetable"
    broken = parse_dags(TRAINING_SCHEDULE="every night")
    (error,) = broken["errors"].values()
    assert "TRAINING_SCHEDULE='every night' is not a cron expression" in error


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_the_deployment_policy_is_read_when_the_dags_are_parsed(tmp_path):
    """The form offers the policy's runtimes and its ceilings as maxima; a broken policy file is an
    import error naming the file and the key (training_airflow/policy.py)."""
    path = tmp_path / "policy.yaml"
    path.write_text("runtimes: {cpu: {backend: local, ceilings: {ranks: 4}}, gpu-8: {backend: kubernetes}}\n"
                    "ceilings: {steps: 5000, wall_clock_s: 7200}\n")
    params = parse_dags(TRAINING_POLICY=str(path))["dags"]["distributed_training"]["params"]
    assert params["runtime"]["schema"]["enum"] == ["cpu", "gpu-8"] and params["runtime"]["default"] == "cpu"
    assert params["world_size"]["schema"]["maximum"] == 4 and params["steps"]["schema"]["maximum"] == 5000
    path.write_text("ceilings: {step: 5000}\n")
    (error, *_) = parse_dags(TRAINING_POLICY=str(path))["errors"].values()
    assert f"policy file {path}: key ceilings.step: is not a key of the policy" in error


def test_new_data_asset_links_registration_to_retraining(parsed):
    dags = parsed["dags"]
    assert dags["register_dataset"]["outlets"] == ["training_dataset"]
    on_data = dags["distributed_training_on_data"]
    assert on_data["timetable"] == "AssetTriggeredTimetable"
    assert on_data["schedule_assets"] == ["training_dataset"]
    assert on_data["catchup"] is False and on_data["max_active_runs"] == 1
