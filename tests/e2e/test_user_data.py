"""The pipeline on data and a model users bring, end to end in the real DAG (Airflow's dag.test()
on SQLite, torchrun with 2 gloo ranks, MLflow on SQLite, moto's S3 server over HTTP on 127.0.0.1):

- scikit-learn's bundled wine table (classification, 13 features on scales from 0.1 to 1,680) as
  train/ and validation/ folders on the local disk;
- its bundled diabetes table (regression) as one table of two Parquet parts on S3, split by
  validation_fraction;

no metadata file in either, trained with the residual MLP of examples/resmlp.py, a module outside
the package put on PYTHONPATH as a user would. Then bad input and drift, each stopped in
validate_data before any rank starts.

Floors: each is a score a linear model reaches on the same rows (the test fits it and checks),
far above what guessing gets (wine: accuracy 0.40 by the largest class; diabetes: R² 0 by the
mean). Wine accuracy >= 0.80: logistic regression scores about 0.93 on these 45 validation rows,
where one row is 2.2 points, so the floor leaves room for five more mistakes than the linear
model on a run of a few hundred steps. Diabetes R² >= 0.35: linear regression scores about 0.5 on
this split; the data is noisy, and R² of small networks on it varies by about 0.05 with the seed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, load_dag

EXAMPLES = ROOT / "examples"
WINE_FLOOR, DIABETES_FLOOR = 0.80, 0.35
FACTORY = {"model": "resmlp:residual_mlp", "model_args": {"width": 32, "blocks": 1, "dropout": 0.1},
           "weight_decay": 0.01, "world_size": 2, "batch_size": 32, "lr": 3e-3, "checkpoint_every": 50,
           "eval_every": 50}


@pytest.fixture
def user_code(monkeypatch):
    """examples/ on PYTHONPATH, for the task processes and the ranks alike."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _frame(name: str) -> pd.DataFrame:
    from sklearn.datasets import load_diabetes, load_wine

    df = load_wine(as_frame=True).frame if name == "wine" else load_diabetes(as_frame=True, scaled=False).frame
    return df.iloc[np.random.default_rng(0).permutation(len(df))].reset_index(drop=True)


def _write(path: Path, df: pd.DataFrame) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)


def _states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}


def _run(experiment: str, dag_run):
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run.run_id}'")
    return client, run


def _artifact(client, run, name: str, tmp_path: Path):
    return json.loads(Path(client.download_artifacts(run.info.run_id, name, str(tmp_path))).read_text())


def _registered_predicts_as_the_checkpoint(name: str, store_uri: str, experiment: str, run_id: str, features,
                                           tmp_path: Path, env=None) -> np.ndarray:
    """The registered model (pyfunc, no pickle) and the checkpoint's model predict the same."""
    from training.checkpoint.export import load_exported
    from training.checkpoint.commit import fetch_checkpoint

    loaded = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    predicted = np.asarray(loaded.predict(features))
    local, _, _ = fetch_checkpoint(store_uri, experiment=experiment, run_id=run_id, dest=tmp_path / "fetched", env=env)
    model, _ = load_exported(local)
    model.eval()  # the user's model has dropout
    with torch.no_grad():
        expected = model(torch.from_numpy(features)).numpy()
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-5)
    return predicted


@pytest.mark.slow
def test_wine_folders_with_a_user_model(airflow_db, user_code, tmp_path, tmp_root):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    df = _frame("wine")
    data = tmp_path / "wine"
    _write(data / "train" / "part-0.parquet", df.iloc[:133])
    _write(data / "validation" / "part-0.parquet", df.iloc[133:])
    store = (tmp_path / "store").as_uri()
    conf = {**FACTORY, "dataset_uri": str(data), "label_column": "target", "experiment": "user-wine", "steps": 150,
            "store_uri": store}

    dag_run = load_dag("distributed_training").test(run_conf=conf)

    assert set(_states(dag_run).values()) == {"success"}, _states(dag_run)
    client, run = _run("user-wine", dag_run)
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert (params["model"], json.loads(params["model_args"])) == (FACTORY["model"], FACTORY["model_args"])
    assert (tags["data.task"], tags["data.label"], tags["data.layout"]) == ("classification", "target", "folders")
    assert tags["data.task_reason"].startswith("label 'target' holds integers (int64) with 3 distinct values")
    schema = _artifact(client, run, "data_schema.json", tmp_path)
    assert schema["fingerprint"] == tags["data.fingerprint"] and schema["schema_source"] == "inferred from the train split"
    assert schema["description"]["classes"] == [0, 1, 2] and len(schema["description"]["features"]) == 13
    assert {c["name"] for c in schema["train_columns"]} == set(df.columns)

    x_train, y_train = df.iloc[:133].drop(columns="target").to_numpy(), df.iloc[:133]["target"].to_numpy()
    x_val, y_val = df.iloc[133:].drop(columns="target").to_numpy(np.float32), df.iloc[133:]["target"].to_numpy()
    linear = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(x_train, y_train).score(x_val, y_val)
    assert linear >= WINE_FLOOR, f"the floor must be one a linear model reaches (it got {linear:.3f})"
    assert metrics["eval/accuracy"] >= WINE_FLOOR, (metrics["eval/accuracy"], linear)

    predicted = _registered_predicts_as_the_checkpoint("user-wine", store, "user-wine", run.info.run_id, x_val, tmp_path)
    assert (predicted.argmax(axis=1) == y_val).mean() == pytest.approx(metrics["eval/accuracy"])
    config = json.loads((Path(mlflow.artifacts.download_artifacts(
        "models:/user-wine@champion", dst_path=str(tmp_path / "registered"))) / "extra_files" / "model_config.json")
        .read_text())
    assert (config["model"], config["model_args"], config["classes"]) == (FACTORY["model"], FACTORY["model_args"],
                                                                          [0, 1, 2])
    # The ranks were told the fingerprint the gate passed, and refuse other bytes (tests/training/test_tables.py).
    train_config = json.loads(Path(tmp_root, "var", "work", run.info.run_id, "train_config.json").read_text())
    assert train_config["dataset_fingerprint"] == tags["data.fingerprint"]


@pytest.mark.slow
def test_diabetes_one_table_on_s3_with_a_user_model(airflow_db, user_code, s3_server, tmp_path):
    from sklearn.linear_model import LinearRegression

    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    for bucket in ("data", "checkpoints"):
        s3.create_bucket(Bucket=bucket)
    df = _frame("diabetes")
    local = tmp_path / "diabetes"
    for i, part in enumerate((df.iloc[:250], df.iloc[250:])):
        _write(local / f"part-{i}.parquet", part)
        s3.upload_file(str(local / f"part-{i}.parquet"), "data", f"tables/diabetes/part-{i}.parquet")
    conf = {**FACTORY, "dataset_uri": "s3://data/tables/diabetes", "label_column": "target",
            "validation_fraction": 0.2, "experiment": "user-diabetes", "steps": 150,
            "store_uri": "s3://checkpoints/team"}

    dag_run = load_dag("distributed_training").test(run_conf=conf)

    assert set(_states(dag_run).values()) == {"success"}, _states(dag_run)
    client, run = _run("user-diabetes", dag_run)
    tags, metrics = run.data.tags, run.data.metrics
    assert (tags["data.task"], tags["data.layout"]) == ("regression", "one table")
    assert tags["data.task_reason"] == "label 'target' holds floating-point numbers (double): regression"
    assert tags["data.split"] == "hash split: validation_fraction=0.2, split_seed=0"
    schema = _artifact(client, run, "data_schema.json", tmp_path)
    assert schema["files"] == {"table": ["part-0.parquet", "part-1.parquet"]}
    assert schema["rows"]["train"] + schema["rows"]["validation"] == len(df)
    assert "eval/accuracy" not in metrics and metrics["eval/rmse"] > 0

    # The same rows as the pipeline's validation split, and a linear model on them.
    from training.data.dataset import open_dataset
    from training.data.options import DataOptions

    ds = open_dataset(local, DataOptions(label_column="target"))
    assert ds.fingerprint == tags["data.fingerprint"], "the fingerprint covers the bytes read from the bucket"
    train, val = ds.split("train"), ds.split("validation")
    linear = LinearRegression().fit(train.features, train.labels).score(val.features, val.labels)
    assert linear >= DIABETES_FLOOR, f"the floor must be one a linear model reaches (it got {linear:.3f})"
    assert metrics["eval/r2"] >= DIABETES_FLOOR, (metrics["eval/r2"], linear)

    assert tags["registry.decision"] == "champion" and "eval/r2" in tags["registry.reason"]
    predicted = _registered_predicts_as_the_checkpoint("user-diabetes", "s3://checkpoints/team", "user-diabetes",
                                                       run.info.run_id, val.features, tmp_path)
    rmse = float(np.sqrt(np.mean((predicted - val.labels) ** 2)))
    assert rmse == pytest.approx(metrics["eval/rmse"], rel=1e-4), "predictions are in the label's units"


@pytest.mark.slow
def test_bad_input_and_drift_stop_the_run_in_validate_data(airflow_db, user_code, tmp_path, tmp_root):
    df = _frame("wine")
    cases = {}
    # A factory that is not there: refused by the pre-launch model check, naming the path.
    ok = tmp_path / "ok"
    _write(ok / "train" / "part-0.parquet", df.iloc[:133])
    _write(ok / "validation" / "part-0.parquet", df.iloc[133:])
    cases["factory"] = {"dataset_uri": str(ok), "model": "resmlp:no_such_function"}
    # Validation drifted from train: a new class, a renamed column, strings, values 1000x out.
    drift = tmp_path / "drift"
    val = df.iloc[133:].copy()
    val.loc[val.index[:2], "target"] = 5
    val = val.rename(columns={"hue": "hue_v2"}).assign(ash=lambda d: d["ash"].map(lambda v: f"{v:.2f}"),
                                                       proline=lambda d: d["proline"] * 1000)
    _write(drift / "train" / "part-0.parquet", df.iloc[:133])
    _write(drift / "validation" / "part-0.parquet", val)
    cases["drift"] = {"dataset_uri": str(drift)}

    for case, changes in cases.items():
        conf = {**FACTORY, "label_column": "target", "experiment": f"user-bad-{case}", "steps": 20,
                "store_uri": (tmp_path / f"store-{case}").as_uri(), **changes}
        dag_run = load_dag("distributed_training").test(run_conf=conf)
        states = _states(dag_run)
        assert states["validate_data"] == "failed" and states["train"] == "upstream_failed", (case, states)
        client, run = _run(f"user-bad-{case}", dag_run)
        assert run.info.status == "FAILED"
        assert not Path(tmp_root, "var", "work", run.info.run_id).exists(), "no rank started"
        assert not (tmp_path / f"store-{case}").exists()
        if case == "factory":
            assert run.data.tags["failure.reason"].startswith(
                "AirflowFailException: invalid run parameters: config field 'model': resmlp:no_such_function: "
                "AttributeError: module 'resmlp' has no attribute 'no_such_function'"), run.data.tags["failure.reason"]
        else:
            failures = _artifact(client, run, "data_validation.json", tmp_path)["failures"]
            for start in ("validation: expect_table_columns_to_match_set: missing ['hue'], unexpected ['hue_v2']",
                          "validation: expect_column_values_to_be_in_type_list(ash): observed dtype str, expected float",
                          "validation: expect_column_max_to_be_between(proline): observed",
                          "validation: expect_column_values_to_be_in_set(target): 2 values outside the set ([0, 1, 2]): [5]"):
                assert any(f.startswith(start) for f in failures), (start, failures)
            assert run.data.tags["data.task"] == "classification"  # what train is was recorded all the same
