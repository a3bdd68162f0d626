"""Every DAG parses fast, without heavy imports, and carries tags, retries and a doc."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "mlflow", "great_expectations", "boto3", "pandas", "pyarrow"]

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from airflow.dag_processing.dagbag import DagBag
t_airflow = time.perf_counter() - t0
t1 = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
t_parse = time.perf_counter() - t1
dags = {}
for dag_id, dag in bag.dags.items():
    dags[dag_id] = {
        "tags": sorted(dag.tags), "doc": bool(dag.doc_md and len(dag.doc_md) > 100),
        "retries": {t.task_id: t.retries for t in dag.tasks},
        "timeouts": {t.task_id: bool(t.execution_timeout) for t in dag.tasks},
        "params": {k: {**v.schema, "description": v.description} for k, v in dag.params.items()},
    }
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": dags,
                  "parse_s": t_parse, "heavy": sorted(m for m in sys.argv[2].split(",") if m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def bag():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "dags"), ",".join(HEAVY)],
                         capture_output=True, text=True, timeout=180, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_import_errors(bag):
    assert bag["errors"] == {}
    assert "distributed_training" in bag["dags"]


def test_parsing_is_fast_and_imports_nothing_heavy(bag):
    assert bag["heavy"] == [], f"DAG parsing imported {bag['heavy']}: move those imports into the tasks"
    # Generous bound on a shared 2-core machine; parsing itself should take well under a second.
    assert bag["parse_s"] < 10, bag["parse_s"]


def test_every_dag_has_tags_doc_retries_and_timeouts(bag):
    for dag_id, d in bag["dags"].items():
        assert d["tags"], dag_id
        assert d["doc"], dag_id
        assert all(r >= 1 for r in d["retries"].values()), d["retries"]
        assert all(d["timeouts"].values()), d["timeouts"]


def test_params_are_typed_and_titled(bag):
    params = bag["dags"]["distributed_training"]["params"]
    for required in ("dataset_uri", "model", "world_size", "steps", "batch_size", "lr", "store_uri"):
        assert required in params
    for name, schema in params.items():
        assert schema.get("type") and schema.get("title") and schema.get("description"), name


def test_the_api_server_checks_the_conf_of_every_dag_with_params(bag):
    """training_airflow/conf_check.py refuses unknown conf keys for the DAGs it lists: every DAG of
    dags/ that has Params, and only those."""
    from training_airflow.conf_check import CHECKED_DAGS

    assert {dag_id for dag_id, d in bag["dags"].items() if d["params"]} == CHECKED_DAGS
