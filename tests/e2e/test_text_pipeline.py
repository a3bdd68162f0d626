"""A language model on your own text, through the whole DAG for real (dag.test, torchrun with 2
gloo ranks, MLflow on SQLite): Python's help text as Parquet documents, a BPE trained on the train
split, the tokenize task's windows, the built-in decoder, bits per byte, samples of its text; then
the same data and tokenizer on moto's S3 server, whose windows the store already holds."""

import json
from pathlib import Path

import boto3
import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import load_dag
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.synthetic import make_text_dataset
from training.data.text import documents, unigram_byte_entropy
from training.results.registry import exported_folder
from training.results.text_model import load_text_folder, predict_text

pytestmark = pytest.mark.slow
TEXT = {"text_column": "text", "model": "transformer", "hidden": 128, "depth": 2, "n_heads": 4, "seq_len": 64,
        "batch_size": 32, "lr": 3e-3, "checkpoint_every": 0, "target_metric": "none", "world_size": 2}


def _run(conf):
    dag_run = load_dag("distributed_training").test(run_conf=conf)
    states = {ti.task_id: str(ti.state).rsplit(".", 1)[-1].lower() for ti in dag_run.get_task_instances()}
    client = MlflowClient()
    exp = client.get_experiment_by_name(conf["experiment"])
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.dag_run_id` = '{dag_run.run_id}'")
    return states, client, run


def test_a_language_model_on_text_then_the_same_text_from_s3(airflow_db, s3_server, tmp_path):
    data = tmp_path / "python-help"
    make_text_dataset(data)
    store = (tmp_path / "store").as_uri()
    states, client, run = _run({**TEXT, "dataset_uri": str(data), "tokenizer": "bpe:600", "steps": 150,
                                "experiment": "text-lm", "store_uri": store})
    assert set(states.values()) == {"success"}, states
    assert states["tokenize"] == "success"
    m, tags = run.data.metrics, run.data.tags
    validation = documents(open_dataset(data, DataOptions(text_column="text")).table("validation"), "text")
    # Below what byte frequencies alone reach: the model learned the text, whatever its tokenizer.
    assert m["eval/bits_per_byte"] < unigram_byte_entropy(validation) - 1.0, m
    assert m["eval/perplexity"] == pytest.approx(2.718281828 ** m["eval/loss"], rel=1e-6)
    assert tags["tokens.cache"] == "made" and tags["tokenizer"] == "bpe:600" and tags["data.task"] == "language_modeling"
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read_text())
    assert summary["validation_tokens"] > 0 and 0.2 < summary["validation_tokens_per_byte"] < 1
    samples = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/samples.json", str(tmp_path))).read_text())
    assert len(samples["prompts"]) == len(samples["greedy"]) == len(samples["sampled"]) == 4
    # A continuation may end at once (the model's end-of-text after a prompt that reads as a whole
    # line, as "* If the target is an identifier (name):" does); most go on: the model writes text.
    assert all(isinstance(s, str) for s in samples["sampled"] + samples["greedy"])
    assert sum(bool(s) for s in samples["sampled"]) >= len(samples["sampled"]) // 2, json.dumps(samples)
    assert "## Prompt 1" in Path(client.download_artifacts(run.info.run_id, "samples/samples.md", str(tmp_path))).read_text()
    # The registered model carries its tokenizer, the one the run trained.
    version = client.get_model_version("text-lm", tags["registry.version"])
    assert version.tags["registry.decision"] == "champion"
    registered = exported_folder(mlflow.artifacts.download_artifacts(f"models:/text-lm/{version.version}",
                                                                     dst_path=str(tmp_path / "reg")))
    run_tokenizer = Path(client.download_artifacts(run.info.run_id, "tokenizer/tokenizer.json", str(tmp_path / "t")))
    assert (registered / "tokenizer.json").read_text() == run_tokenizer.read_text()
    # It answers text with text: the continuations the checkpoint's model makes.
    prompts = ["The import statement", "A list is"]
    served = mlflow.pyfunc.load_model("models:/text-lm@champion").predict(pd.DataFrame({"text": prompts}),
                                                                         params={"new_tokens": 12})
    checkpoint = tmp_path / "store" / "text-lm" / run.info.run_id / tags["checkpoint.uri"].rsplit("/", 1)[-1]
    assert served == predict_text(*load_text_folder(checkpoint), prompts, new_tokens=12)
    assert all(isinstance(s, str) for s in served) and any(served)

    # The same documents and tokenizer, now in S3: the store holds their windows already.
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="corpus")
    for f in data.rglob("*.parquet"):
        s3.upload_file(str(f), "corpus", f"python-help/{f.relative_to(data).as_posix()}")
    s3.upload_file(str(run_tokenizer), "corpus", "tokenizers/bpe-600.json")
    states, client, again = _run({**TEXT, "dataset_uri": "s3://corpus/python-help", "steps": 20,
                                  "tokenizer": "s3://corpus/tokenizers/bpe-600.json", "experiment": "text-lm",
                                  "store_uri": store})
    assert set(states.values()) == {"success"}, states
    t = again.data.tags
    assert t["tokens.cache"] == "hit" and t["tokens.uri"] == tags["tokens.uri"], (t["tokens.cache"], t["tokens.uri"])
    assert t["tokenizer.sha256"] == tags["tokenizer.sha256"] and t["data.fingerprint"] == tags["data.fingerprint"]
    # 20 steps do not beat 150 on bits per byte: the registry keeps the champion.
    assert t["registry.decision"] == "challenger" and "eval/bits_per_byte" in t["registry.reason"]


def test_text_with_a_label_trains_a_classifier(airflow_db, tmp_path):
    data = tmp_path / "code-or-prose"
    make_text_dataset(data, labels=True, names=True)  # the classes by name: code, prose
    states, client, run = _run({**TEXT, "dataset_uri": str(data), "tokenizer": "bpe:512", "steps": 100,
                                "experiment": "text-classes", "store_uri": (tmp_path / "store").as_uri()})
    assert set(states.values()) == {"success"}, states
    m, tags = run.data.metrics, run.data.tags
    assert tags["data.task"] == "classification" and tags["data.label"] == "label"
    assert m["eval/accuracy"] > 0.85, m  # code and grammar against prose; the shares are 44% / 56%
    assert "eval/bits_per_byte" not in m
    assert m["perf/tokens_per_s"] == pytest.approx(m["perf/samples_per_s"] * TEXT["seq_len"], rel=1e-6)
    files = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert "evaluation/confusion_matrix.png" in files
    assert tags["registry.decision"] == "champion" and "eval/accuracy" in tags["registry.reason"]
    # The registered model takes documents and returns their classes, as the checkpoint's model does.
    docs = documents(open_dataset(data, DataOptions(text_column="text")).table("validation"), "text")[:40]
    served = mlflow.pyfunc.load_model("models:/text-classes@champion").predict(pd.DataFrame({"text": docs}))
    checkpoint = tmp_path / "store" / "text-classes" / run.info.run_id / tags["checkpoint.uri"].rsplit("/", 1)[-1]
    assert list(served) == predict_text(*load_text_folder(checkpoint), docs)
    assert set(served) == {"code", "prose"}, served  # both classes among 40 documents, by name
