"""The whole DAG, for real: Airflow's dag.test() (SQLite metadata DB), torchrun with 2 gloo ranks,
MLflow on a SQLite store, and the checkpoint store on moto's S3 server over HTTP on 127.0.0.1."""

import hashlib
import json
import shutil
from urllib.parse import quote

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import load_dag

STEPS = 200


def _ti_states(dag_run):
    return {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}


def _mlflow_run(dag_run, experiment):
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run.run_id}'")
    assert len(runs) == 1, "one DAG run must map to exactly one MLflow run"
    return client, runs[0]


@pytest.mark.slow
def test_full_pipeline_on_s3(airflow_db, dataset, s3_server, tmp_path, tmp_root):
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="checkpoints")
    conf = {"dataset_uri": str(dataset), "experiment": "e2e", "world_size": 2, "steps": STEPS, "batch_size": 64,
            "lr": 3e-3, "checkpoint_every": 50, "store_uri": "s3://checkpoints/team"}

    dag_run = load_dag("distributed_training").test(run_conf=conf)

    # The default deployment offers the local backend only: its task group and nothing else.
    assert _ti_states(dag_run) == {t: "success" for t in ("open_run", "validate_data", "tokenize", "train", "upload_checkpoint", "evaluate",
                                                          "register", "report")}
    client, run = _mlflow_run(dag_run, "e2e")
    assert run.info.status == "FINISHED"
    p, m, tags = run.data.params, run.data.metrics, run.data.tags
    assert (p["steps"], p["batch_size"], p["world_size"], p["model"], p["backend"]) == (str(STEPS), "64", "2", "mlp", "gloo")
    assert tags["airflow.dag_id"] == "distributed_training" and tags["airflow.dag_run_id"] == dag_run.run_id
    assert tags["data.validation"] == "passed"

    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [h.step for h in loss] == list(range(10, STEPS + 1, 10)), "one point per log interval, no duplicates"
    assert loss[-1].value < 0.8 * loss[0].value, [h.value for h in loss]
    for name in ("perf/samples_per_s", "comm/s_per_step"):
        assert all(h.value > 0 for h in client.get_metric_history(run.info.run_id, name)), name
    # The teacher dataset has 10% label noise over 4 classes: the best reachable accuracy is
    # 1 - 0.1 * 3/4 = 0.925 and chance is 0.25. 200 steps of a small MLP reliably get past 0.70,
    # far above chance and a loose bound below the ceiling (it scores about 0.8 here).
    meta = json.loads((dataset / "dataset.json").read_text())
    assert meta["bayes_accuracy"] == pytest.approx(0.925)
    assert 0.70 <= m["eval/accuracy"] <= meta["bayes_accuracy"] + 0.03
    assert m["eval/loss"] < loss[0].value

    # The bucket holds the final checkpoint, and the manifest's sha256 values match the objects.
    prefix = f"team/e2e/{run.info.run_id}"
    assert tags["checkpoint.uri"] == f"s3://checkpoints/{prefix}/step_{STEPS:08d}"
    manifest = json.loads(s3.get_object(Bucket="checkpoints", Key=f"{prefix}/step_{STEPS:08d}/manifest.json")["Body"].read())
    assert manifest["step"] == STEPS and manifest["world_size"] == 2
    names = {f["path"] for f in manifest["files"]}
    # DCP metadata + one shard and one RNG-state file per rank, the portable model.
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt",
                     "model.safetensors", "model_config.json"}
    for f in manifest["files"]:
        body = s3.get_object(Bucket="checkpoints", Key=f"{prefix}/step_{STEPS:08d}/{f['path']}")["Body"].read()
        assert (len(body), hashlib.sha256(body).hexdigest()) == (f["size"], f["sha256"]), f["path"]
    latest = json.loads(s3.get_object(Bucket="checkpoints", Key=f"{prefix}/latest")["Body"].read())
    assert latest["step_dir"] == f"step_{STEPS:08d}"
    # The ranks committed every checkpoint to the bucket themselves (checkpoint_location=store), and
    # retention kept the last 3: nothing of them lives on the worker's disk.
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="checkpoints", Prefix=f"{prefix}/")["Contents"]]
    assert {k.split("/")[3] for k in keys if "/step_" in k} == {"step_00000100", "step_00000150", "step_00000200"}
    assert all(f"{prefix}/step_{s:08d}/manifest.json" in keys for s in (100, 150, 200))
    assert not (tmp_root / "var" / "work" / run.info.run_id / "checkpoints").exists()
    assert [h.step for h in client.get_metric_history(run.info.run_id, "ckpt/save_s")] == [50, 100, 150, 200]
    _reads_back_as_a_person_would(client, run, dataset)


@pytest.mark.slow
def test_a_missing_bucket_stops_the_run_before_training(airflow_db, dataset, s3_server, tmp_root):
    dag_run = load_dag("distributed_training").test(
        run_conf={"dataset_uri": str(dataset), "experiment": "e2e-nobucket", "steps": 5, "store_uri": "s3://nope/team"})
    states = _ti_states(dag_run)
    assert states["open_run"] == "failed" and states["validate_data"] == "upstream_failed", states
    assert states["train"] == "upstream_failed", states
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == "open_run")
    assert ti.try_number == 1, "bad input fails without retries"


def _reads_back_as_a_person_would(client, run, dataset):
    """The MLflow run read back with MlflowClient: what its page, the runs table and compare show."""
    rid, tags, params = run.info.run_id, run.data.tags, run.data.params
    assert run.info.run_name == f"mlp-ddp-fp32-2ranks-{STEPS}steps"  # readable; the Airflow run id is a tag
    assert tags["airflow.url"].endswith(quote(tags["airflow.dag_run_id"], safe=""))
    (data,) = run.inputs.dataset_inputs  # the Dataset column: name and fingerprint, with the schema
    assert (data.dataset.name, data.dataset.digest) == ("teacher", tags["data.fingerprint"][:32])
    assert [c["name"] for c in json.loads(data.dataset.schema)["mlflow_colspec"]][-1] == "label"
    # Params are what a person chose: no path or hash that differs for every run by construction.
    assert not {"checkpoint_dir", "output_dir", "config_hash", "perf/peak_flops", "perf/peak_source"} & set(params)
    assert not [k for k, v in params.items() if rid in v or "/work/" in v], params
    assert rid in tags["checkpoint_dir"] and tags["config_hash"] and tags["perf/peak_flops"]
    # One-off figures: the run summary (file), the headline ones also one-value metrics and tags.
    summary = json.loads(open(client.download_artifacts(rid, "summary.json")).read())
    for name in ("goodput", "dag_wall_s", "orchestration_overhead_s", "torchrun_wall_s"):
        assert run.data.metrics[name] == pytest.approx(summary[name], rel=1e-9), name
        assert [h.step for h in client.get_metric_history(rid, name)] == [0], "one value each"
    assert summary["dag_wall_s"] > summary["torchrun_wall_s"] > 0 and 0 < summary["goodput"] <= 1
    assert float(tags["summary.dag_wall_s"]) == pytest.approx(summary["dag_wall_s"], rel=1e-7)
    assert tags["progress"] == f"{STEPS}/{STEPS} steps (100%)"
    files = {a.path for d in ("", "plots", "evaluation", "logs") for a in client.list_artifacts(rid, d or None)}
    assert {"plots/loss_eval.png", "plots/throughput_step_time.png", "evaluation/report.html",
            "evaluation/confusion_matrix.png", "evaluation/report.json", "logs/train.log", "train_config.json",
            "data_gate.html", "summary.json", "data_validation.json"} <= files, files
    config = json.loads(open(client.download_artifacts(rid, "train_config.json")).read())
    assert config["steps"] == STEPS and config["checkpoint_dir"] == tags["checkpoint_dir"]
    assert f"step {STEPS}/{STEPS} | loss" in open(client.download_artifacts(rid, "logs/train.log")).read()
    report = json.loads(open(client.download_artifacts(rid, "evaluation/report.json")).read())
    assert report["task"] == "classification" and len(report["classes"]) == 4
    assert report["accuracy"] == pytest.approx(run.data.metrics["eval/accuracy"], abs=1e-9)
    assert sum(map(sum, report["confusion_matrix"])) == report["rows"] == 2_000
    # The description, the first thing the run's page shows: status, the link back, figures, plots.
    note = tags["mlflow.note.content"]
    assert note.startswith("**FINISHED**") and f"]({tags['airflow.url']})" in note
    assert "plots/loss_eval.png" in note and "**Registry:**" in note and "champion" in note
    # System metrics even in a run of a few seconds.
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)


@pytest.mark.slow
def test_bad_data_stops_the_run_before_training(airflow_db, dataset, tmp_path, tmp_root):
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    path = bad / "train" / "part-00000.parquet"
    df = pq.read_table(path).to_pandas()
    df.loc[:49, "f5"] = np.nan
    df.loc[100:102, "label"] = 9
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)

    from training_airflow.inprocess_logs import log_path, task_logs_to_files

    with task_logs_to_files():  # as make demo runs it: each task's log where the Airflow UI reads it
        dag_run = load_dag("distributed_training").test(
            run_conf={"dataset_uri": str(bad), "experiment": "e2e-bad", "steps": 5, "store_uri": (tmp_path / "s").as_uri()})

    states = _ti_states(dag_run)
    assert states["validate_data"] == "failed"
    assert all(states[t] == "upstream_failed" for t in ("train", "upload_checkpoint", "evaluate", "register",
                                                        "report")), states
    client, run = _mlflow_run(dag_run, "e2e-bad")
    assert run.info.status == "FAILED" and run.data.tags["data.validation"] == "failed"
    verdict = json.loads(open(client.download_artifacts(run.info.run_id, "data_validation.json")).read())
    assert "train: expect_column_values_to_not_be_null(f5): 50 bad values" in verdict["failures"]
    assert any(f.startswith("train: expect_column_values_to_be_in_set(label): 3 values outside the set (") and ": [9]" in f
               for f in verdict["failures"]), verdict["failures"]
    (ti,) = [t for t in dag_run.get_task_instances() if t.task_id == "validate_data"]
    events = [json.loads(line)["event"] for line in log_path(ti).read_text().splitlines()]
    assert any("train: expect_column_values_to_not_be_null(f5): 50 bad values" in e for e in events), events
    assert any(e.startswith("Task failed") for e in events), "the failed task's reason is in its log"
    # No rank ever started: the train task never created its work folder.
    assert not (tmp_root / "var" / "work" / run.info.run_id).exists()
    assert not (tmp_path / "s").exists()
