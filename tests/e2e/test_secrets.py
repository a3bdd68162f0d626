"""Secrets hygiene, end to end: recognizable secrets planted as the worker's AWS_SECRET_ACCESS_KEY
and as the password of the Airflow connection named in aws_conn_id; one full DAG run with the S3
store (moto's server on 127.0.0.1 accepts any key); then every place a secret could leak is
searched: the task logs and all captured output (the rendered torchrun command included), the
MLflow store (params, tags, metric keys, artifact files, the SQLite file), the Airflow metadata DB
(the XCom table and the whole file), the run's work folder and the bucket. Zero hits."""

import json
import os
import sqlite3
from pathlib import Path

import boto3
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port, load_dag

SECRET_ENV = "PlantedEnvSecret7Qx2Vb9Lk4Zr"
SECRET_CONN = "PlantedConnSecret3Mw8Hy5Tn1Jd"
SECRETS = (SECRET_ENV, SECRET_CONN)


def _hits_in_files(root: Path) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            hits += [f"{p}: {s}" for s in SECRETS if s.encode() in data]
    return hits


@pytest.mark.slow
def test_no_secret_reaches_logs_mlflow_xcom_or_the_command(airflow_db, dataset, s3_server, tmp_path, tmp_root,
                                                           monkeypatch, capfd, caplog):
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="secret-test")
    # The worker's own AWS environment holds a secret and points at a dead endpoint: the run can
    # only succeed through the connection's endpoint, so the connection is really used.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ENV)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_S3", json.dumps({
        "conn_type": "aws", "login": "AKIAPLANTEDKEYID", "password": SECRET_CONN,
        "extra": {"endpoint_url": s3_server["endpoint"], "region_name": "us-east-1"}}))

    conf = {"dataset_uri": str(dataset), "experiment": "secrets", "world_size": 1, "steps": 20, "batch_size": 64,
            "checkpoint_every": 10, "store_uri": "s3://secret-test/p", "aws_conn_id": "ckpt_s3"}
    dag_run = load_dag("distributed_training").test(run_conf=conf)

    states = {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}
    assert all(states[t] == "success" for t in ("open_run", "validate_data", "train", "upload_checkpoint", "evaluate", "report")), states
    client = MlflowClient()
    exp = client.get_experiment_by_name("secrets")
    [run] = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run.run_id}'")
    prefix = f"p/secrets/{run.info.run_id}"
    assert json.loads(s3.get_object(Bucket="secret-test", Key=f"{prefix}/latest")["Body"].read())["step"] == 20

    # 1. Every task log line and everything printed (torchrun's and the ranks' output included).
    out = capfd.readouterr()
    printed = out.out + out.err + "\n".join(r.getMessage() for r in caplog.records)
    launch = [line for line in printed.splitlines() if "launching:" in line and "torch.distributed.run" in line]
    assert launch, "the rendered torchrun command is in the log"
    logs = Path(os.environ["AIRFLOW_HOME"]) / "logs"
    leaks = [s for s in SECRETS if s in printed] + (_hits_in_files(logs) if logs.exists() else [])

    # 2. MLflow: params, tags, metric keys, every artifact file, the SQLite file itself.
    data = run.data
    assert data.params and data.tags and data.metrics
    for s in SECRETS:
        leaks += [f"param {k}" for k, v in data.params.items() if s in k or s in v]
        leaks += [f"tag {k}" for k, v in data.tags.items() if s in k or s in v]
        leaks += [f"metric {k}" for k in data.metrics if s in k]
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_dir() and any(artifacts.rglob("*.json"))
    leaks += _hits_in_files(artifacts)
    db = Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))
    leaks += [f"mlflow db: {s}" for s in SECRETS if s.encode() in db.read_bytes()]

    # 3. Airflow metadata DB: the XCom table, then the whole file.
    airflow_db_path = Path(os.environ["AIRFLOW_HOME"]) / "airflow.db"
    with sqlite3.connect(airflow_db_path) as con:
        rows = con.execute("SELECT task_id, key, value FROM xcom WHERE run_id = ?", (dag_run.run_id,)).fetchall()
    assert {r[0] for r in rows} >= {"open_run", "validate_data", "train", "upload_checkpoint", "evaluate"}, rows
    leaks += [f"xcom {r[0]}/{r[1]}" for r in rows for s in SECRETS if s in str(r[2])]
    leaks += [f"airflow db: {s}" for s in SECRETS if s.encode() in airflow_db_path.read_bytes()]

    # 4. The run's work folder (train_config.json, summaries) and the bucket's objects.
    leaks += _hits_in_files(tmp_root / "var" / "work" / run.info.run_id)
    for o in s3.list_objects_v2(Bucket="secret-test", Prefix=prefix)["Contents"]:
        body = s3.get_object(Bucket="secret-test", Key=o["Key"])["Body"].read()
        leaks += [f"s3 {o['Key']}" for s in SECRETS if s.encode() in body]

    assert leaks == []

    # The search itself finds a planted value (so "zero hits" means something).
    canary = tmp_path / "canary" / "x.txt"
    canary.parent.mkdir()
    canary.write_text(f"key={SECRET_CONN}")
    assert _hits_in_files(canary.parent) == [f"{canary}: {SECRET_CONN}"]
