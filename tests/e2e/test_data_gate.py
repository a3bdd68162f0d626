"""The data gate in the real DAG (Airflow's dag.test() on SQLite, MLflow on SQLite): a dataset with
too many duplicate rows stops the run in validate_data, no rank ever starts, and the MLflow run
holds the verdict (failed expectations with observed values, the data fingerprint) and GX's Data Docs."""

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import load_dag


@pytest.mark.slow
def test_duplicate_rows_stop_the_dag_before_any_rank(airflow_db, dataset, tmp_path, tmp_root, capfd):
    bad = tmp_path / "dups"
    shutil.copytree(dataset, bad)
    path = bad / "validation" / "part-00000.parquet"
    df = pq.read_table(path).to_pandas()
    pq.write_table(pa.Table.from_pandas(pd.concat([df, df.iloc[:200]], ignore_index=True), preserve_index=False), path)

    dag_run = load_dag("distributed_training").test(run_conf={
        "dataset_uri": str(bad), "experiment": "gate-dups", "world_size": 1, "steps": 5,
        "store_uri": (tmp_path / "store").as_uri()})

    states = {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}
    assert states["validate_data"] == "failed"
    assert states["train"] == "upstream_failed", states

    line = "validation: expect_rows_to_be_unique(all columns): 400 of 2200 rows are duplicated (18.18%, allowed 1.00%)"
    out = capfd.readouterr()
    log = out.out + out.err
    assert line in log, "the task log names the failed expectation in one line"
    assert "torch.distributed.run" not in log and "launching:" not in log, "no rank started"

    client = MlflowClient()
    exp = client.get_experiment_by_name("gate-dups")
    [run] = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run.run_id}'")
    assert not (tmp_root / "var" / "work" / run.info.run_id).exists() and not (tmp_path / "store").exists()
    assert run.info.status == "FAILED"
    tags = run.data.tags
    assert tags["data.validation"] == "failed" and tags["data.failed_expectations"] == "1"
    assert tags["data.rows_validation"] == "2200" and tags["data.rows_train"] == "8000"

    verdict = json.loads(Path(client.download_artifacts(run.info.run_id, "data_validation.json", str(tmp_path))).read_text())
    assert verdict["success"] is False and verdict["failures"] == [line]
    [failed] = verdict["failed_expectations"]
    assert (failed["split"], failed["expectation"], failed["column"], failed["observed"]) == (
        "validation", "expect_rows_to_be_unique", "all columns", round(400 / 2200, 6))
    assert tags["data.fingerprint"] == verdict["fingerprint"]
    assert {f["path"]: f["sha256"] for f in verdict["files"]}["validation/part-00000.parquet"] == \
        hashlib.sha256(path.read_bytes()).hexdigest()

    docs = [a.path for a in client.list_artifacts(run.info.run_id, "data_docs")]
    assert "data_docs/index.html" in docs and "data_docs/validations" in docs
    index = Path(client.download_artifacts(run.info.run_id, "data_docs/index.html", str(tmp_path))).read_text()
    assert "gate" in index.lower() or "validation" in index.lower()
