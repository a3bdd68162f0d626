"""The Airflow plugin of this project, as Airflow's plugin loader of every part (api-server,
scheduler, dag-processor, workers) imports it: it registers the "MLflow run" link on every task and
the listener that copies a run's note, and imports nothing heavy. What the link opens and the note
are checked against the live servers (tests/e2e/test_live_ui.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

HEAVY = ("mlflow", "torch", "great_expectations", "boto3", "pandas", "pyarrow")


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_the_plugin_registers_the_mlflow_link_and_imports_nothing_heavy():
    code = ("import json, sys; sys.path.insert(0, 'plugins'); import training_links as p; "
            "print(json.dumps({'links': [l.name for l in p.TrainingLinks.global_operator_extra_links], "
            "'listeners': [type(l).__name__ for l in p.TrainingLinks.listeners], "
            f"'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"links": ["MLflow run"], "listeners": ["RunNoteListener"], "heavy": []}


def test_a_dag_run_without_an_mlflow_run_gets_no_link(tmp_root):
    from types import SimpleNamespace

    from training_airflow.links import MLflowRunLink

    key = SimpleNamespace(dag_id="register_dataset", run_id="manual__nothing-in-mlflow")
    assert MLflowRunLink().get_link(None, ti_key=key) == ""
