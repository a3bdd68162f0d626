"""Every DAG parses fast, without heavy imports, and carries tags, retries and a doc."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "mlflow", "great_expectations", "boto3", "pandas", "pyarrow"]


def describe(bag) -> dict:
    """What the tests check of each DAG a ``DagBag`` parsed."""
    dags = {}
    for dag_id, dag in bag.dags.items():
        dags[dag_id] = {
            "tags": sorted(dag.tags), "doc": bool(dag.doc_md and len(dag.doc_md) > 100),
            "retries": {t.task_id: t.retries for t in dag.tasks},
            "timeouts": {t.task_id: bool(t.execution_timeout) for t in dag.tasks},
            "params": {k: {**v.schema, "description": v.description} for k, v in dag.params.items()},
        }
    return {"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": dags}


# A fresh interpreter, to see what parsing alone imports and how long it takes.
PROBE = r"""
import json, sys, time
from airflow.dag_processing.dagbag import DagBag
t1 = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
t_parse = time.perf_counter() - t1
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "parse_s": t_parse,
                  "heavy": sorted(m for m in sys.argv[2].split(",") if m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def bag():
    """The DAG folder parsed in this process (the structure; make test-fast starts no process)."""
    from airflow.dag_processing.dagbag import DagBag

    return describe(DagBag(dag_folder=str(ROOT / "dags")))


def test_no_import_errors(bag):
    assert bag["errors"] == {}
    assert "distributed_training" in bag["dags"]


@pytest.mark.slow  # a fresh interpreter: this process has imported everything already
def test_parsing_is_fast_and_imports_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "dags"), ",".join(HEAVY)],
                         capture_output=True, text=True, timeout=180, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["errors"] == {}
    assert probe["heavy"] == [], f"DAG parsing imported {probe['heavy']}: move those imports into the tasks"
    # Generous bound on a shared 2-core machine; parsing itself should take well under a second.
    assert probe["parse_s"] < 10, probe["parse_s"]


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
