"""A table without any metadata file: the gate infers the schema from the train split and checks
validation against it (drift fails, naming each problem); the task is inferred by the stated rule;
bad input is refused with the field to fix (exit code 2 on the command line, nothing started);
``describe-data`` pins the inferred schema as a dataset.json the gate then uses.

The data is scikit-learn's bundled wine table (178 rows, 13 float features on very different
scales, 3 classes), written as plain Parquet."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.data.dataset import open_dataset
from training.config.fields import ConfigError
from training.data.schema import MAX_CLASSES
from training.data.options import DataOptions
from training.data.gate import DataValidationError, validate

WINE = DataOptions(label_column="target")
CULTIVARS = {0: "barolo", 1: "grignolino", 2: "barbera"}


def wine_frame() -> pd.DataFrame:
    """The 178 rows in a fixed random order (the bundled file is sorted by class)."""
    from sklearn.datasets import load_wine

    df = load_wine(as_frame=True).frame
    return df.iloc[np.random.default_rng(0).permutation(len(df))].reset_index(drop=True)


def write_splits(root, train: pd.DataFrame, val: pd.DataFrame):
    for split, df in (("train", train), ("validation", val)):
        (root / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), root / split / "part-0.parquet")
    return root


@pytest.fixture
def wine(tmp_path):
    df = wine_frame()
    return write_splits(tmp_path / "wine", df.iloc[:133], df.iloc[133:])


def _gate_failures(root, options=WINE) -> list[str]:
    with pytest.raises(DataValidationError) as err:
        validate(str(root), options=options)
    return err.value.report["failures"]


def test_the_schema_is_inferred_from_train_and_recorded(wine):
    report = validate(str(wine), options=WINE)
    assert report["success"] and report["rows"] == {"train": 133, "validation": 45}
    ds = report["data_schema"]
    assert ds["schema_source"] == "inferred from the train split" and ds["layout"] == "folders"
    d = ds["description"]
    assert (d["label"], d["task"], d["classes"], d["n_classes"], d["normalize"]) == ("target", "classification",
                                                                                      [0, 1, 2], 3, True)
    assert d["task_reason"] == ("label 'target' holds integers (int64) with 3 distinct values in train "
                                f"(at most {MAX_CLASSES}): classification")
    assert d["features"] == [c for c in wine_frame().columns if c != "target"]
    train = pq.read_table(wine / "train").to_pandas()
    shares = {c["class"]: c["share"] for c in ds["classes"]}
    assert shares == {k: round(v, 6) for k, v in train["target"].value_counts(normalize=True).items()}
    proline = next(c for c in ds["train_columns"] if c["name"] == "proline")
    assert (proline["min"], proline["max"], proline["missing"]) == (train.proline.min(), train.proline.max(), 0)
    assert proline["mean"] == pytest.approx(train.proline.mean())
    # Validation may reach one train range beyond train's min and max, no further.
    col = next(c for c in report["schema"]["columns"] if c["name"] == "proline")
    lo, hi = train.proline.min(), train.proline.max()
    assert (col["min"], col["max"]) == (lo - (hi - lo), hi + (hi - lo))
    assert next(c for c in report["schema"]["columns"] if c["name"] == "target")["values"] == [0, 1, 2]
    assert report["fingerprint"] == ds["fingerprint"]


@pytest.mark.parametrize("label, task, expected, reason", [
    (np.arange(200) % 3, "auto", "classification", "holds integers (int64) with 3 distinct values"),
    (np.arange(200) % (MAX_CLASSES + 1), "auto", "regression",
     f"holds integers with {MAX_CLASSES + 1} distinct values in train (more than {MAX_CLASSES}): regression"),
    (np.linspace(0, 1, 200), "auto", "regression", "holds floating-point numbers (double): regression"),
    (np.arange(200) % 2 == 0, "auto", "classification", "holds integers (bool) with 2 distinct values"),
    ((np.arange(200) % 4).astype(float), "classification", "classification", "task=classification (set)"),
    (np.arange(200) % 3, "regression", "regression", "task=regression (set)"),
])
def test_the_task_rule(tmp_path, label, task, expected, reason):
    x = np.random.default_rng(0).normal(size=200)
    pq.write_table(pa.table({"x": x, "y": label}), tmp_path / "t.parquet")
    meta = open_dataset(tmp_path / "t.parquet", DataOptions(label_column="y", task=task)).meta
    assert meta["task"] == expected and reason in meta["task_reason"]
    assert meta["n_classes"] == (len(np.unique(label)) if expected == "classification" else 1)


def _drifted(df: pd.DataFrame, train: pd.DataFrame, kind: str) -> pd.DataFrame:
    df = df.copy()
    if kind in ("class", "all"):
        df.loc[df.index[:3], "target"] = 7
    if kind in ("rename", "all"):
        df = df.rename(columns={"hue": "hue_v2"})
    if kind in ("strings", "all"):
        df["ash"] = df["ash"].map(lambda v: f"{v:.2f}")
    if kind in ("scale", "all"):
        df["proline"] = df["proline"] * 1000
    return df


@pytest.mark.parametrize("kind, lines", [
    ("class", ["validation: expect_column_values_to_be_in_set(target): 3 values outside the set ([0, 1, 2]): [7]"]),
    ("rename", ["validation: expect_table_columns_to_match_set: missing ['hue'], unexpected ['hue_v2']"]),
    ("strings", ["validation: expect_column_values_to_be_in_type_list(ash): observed dtype str, expected float"]),
    ("scale", ["validation: expect_column_min_to_be_between(proline)", "validation: expect_column_max_to_be_between(proline)"]),
])
def test_drift_from_train_fails_the_gate_naming_it(tmp_path, kind, lines):
    df = wine_frame()
    train, val = df.iloc[:130], df.iloc[130:]
    root = write_splits(tmp_path / kind, train, _drifted(val, train, kind))
    failures = _gate_failures(root)
    for line in lines:
        assert any(f.startswith(line) for f in failures), (line, failures)
    assert not any(f.startswith("train:") for f in failures)  # train is what validation is held against


def test_all_drifts_at_once_are_each_named(tmp_path):
    df = wine_frame()
    root = write_splits(tmp_path / "all", df.iloc[:130], _drifted(df.iloc[130:], df.iloc[:130], "all"))
    failures = _gate_failures(root)
    for start in ("validation: expect_column_values_to_be_in_set(target): 3 values outside the set",
                  "validation: expect_table_columns_to_match_set: missing ['hue'], unexpected ['hue_v2']",
                  "validation: expect_column_values_to_be_in_type_list(ash): observed dtype str, expected float",
                  "validation: expect_column_max_to_be_between(proline): observed"):
        assert any(f.startswith(start) for f in failures), (start, failures)


def _bad_table(tmp_path, change) -> str:
    df = wine_frame()
    df = change(df.copy()) if change else df
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    return str(path)


BAD_INPUT = [
    # (what the table looks like, options, the field, the message)
    (lambda df: df.rename(columns={"target": "cultivar"}), WINE, "label_column",
     "'target' is not a column of the train split (its columns: alcohol, malic_acid"),
    (lambda df: df.assign(target=df["target"].astype("Int64").mask(df.index % 50 == 0)), WINE, "label_column",
     "missing values (null or NaN) in the train split"),
    (lambda df: df.assign(target=df["target"].map(CULTIVARS)), DataOptions(label_column="target", task="regression"),
     "task", "regression needs numbers but label 'target' holds names"),
    (lambda df: df.assign(target=[f"c{i}" for i in range(len(df))]), WINE, "label_column",  # train: 141 of the rows
     f"'target' holds 141 distinct names in train, more than the {MAX_CLASSES} classes task=auto infers"),
    (lambda df: df.assign(target=[[1]] * len(df)), WINE, "label_column",
     "'target' holds list<element: int64> values, neither numbers nor class names"),
    (lambda df: df.assign(target=1), WINE, "label_column",
     "'target' has a single class (1) in the train split: there is nothing to tell apart"),
    (lambda df: df.assign(region=["north", "south"] * 89), DataOptions(label_column="target",
     feature_columns=("alcohol", "region", "hue")), "feature_columns", "non-numeric columns: region (string)"),
    (lambda df: df.assign(tags=[[1, 2]] * 178), DataOptions(label_column="target", feature_columns=("alcohol", "tags")),
     "feature_columns", "non-numeric columns: tags (list<element: int64>)"),
    (lambda df: df[["target"]].assign(name="x"), WINE, "feature_columns",
     "the train split has no numeric column besides the label 'target' (its other columns: name (string))"),
    (lambda df: df.assign(target=df["target"] + 0.5), DataOptions(label_column="target", task="classification"),
     "task", "classification needs whole-number labels but 'target' holds 0.5"),
    (None, DataOptions(label_column="target", feature_columns=("alcohol", "colour")), "feature_columns",
     "colour not in the train split"),
]


def test_class_names_as_labels_train_a_classifier_of_those_names(tmp_path):
    from training.data.arrays import to_arrays

    df = wine_frame().assign(target=lambda d: d["target"].map(CULTIVARS))
    root = write_splits(tmp_path / "named", df.iloc[:133], df.iloc[133:])
    report = validate(str(root), options=WINE)
    d = report["data_schema"]["description"]
    assert (d["task"], d["classes"], d["n_classes"]) == ("classification", ["barbera", "barolo", "grignolino"], 3)
    assert d["task_reason"] == "label 'target' holds class names (3 distinct in train): classification"
    ds = open_dataset(str(root), WINE)
    split = to_arrays(ds.table("validation"), ds.columns())
    names = ds.table("validation").column("target").to_pylist()
    assert [d["classes"][i] for i in split.labels] == names  # each row's class index is its name's
    # A class validation holds and train lacks fails the gate, named.
    val = df.iloc[133:].copy()
    val.loc[val.index[:2], "target"] = "nebbiolo"
    bad = write_splits(tmp_path / "unseen", df.iloc[:133], val)
    assert _gate_failures(bad) == ["validation: expect_column_values_to_be_in_set(target): 2 values outside the set "
                                   "(['barbera', 'barolo', 'grignolino']): ['nebbiolo']"]


@pytest.mark.parametrize("change, options, field, message", BAD_INPUT)
def test_bad_input_names_the_field(tmp_path, change, options, field, message):
    uri = _bad_table(tmp_path, change)
    with pytest.raises(ConfigError) as err:
        open_dataset(uri, options).meta
    assert err.value.field == field and message in str(err.value) and "Fix:" in str(err.value)
    # The gate reports the same line (and records it in the run), before anything trains.
    assert _gate_failures(uri, options) == [str(err.value)]


def test_strings_beside_numbers_are_not_features_unless_named(tmp_path):
    uri = _bad_table(tmp_path, lambda df: df.assign(region=["north", "south"] * 89))
    meta = open_dataset(uri, WINE).meta
    assert "region" not in meta["features"] and meta["ignored_columns"] == ["region (string)"]
    report = validate(uri, options=WINE)
    assert report["data_schema"]["description"]["ignored_columns"] == ["region (string)"]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "training", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_cli_refuses_bad_input_with_exit_2_before_anything_starts(tmp_path):
    uri = _bad_table(tmp_path, lambda df: df.rename(columns={"target": "cultivar"}))
    out = _cli("train", "--set", f"dataset_uri={uri}", "--set", "label_column=target",
               "--set", f"checkpoint_dir={tmp_path / 'ck'}")
    assert out.returncode == 2
    assert "error: config field 'label_column': 'target' is not a column of the train split" in out.stderr
    assert not (tmp_path / "ck").exists()
    gate = _cli("validate", "--dataset-uri", uri, "--label-column", "target")
    assert gate.returncode == 2 and "  - config field 'label_column': 'target' is not a column" in gate.stderr


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_describe_data_pins_the_schema_and_the_gate_uses_it(wine, tmp_path):
    out = _cli("describe-data", str(wine), "--label-column", "target")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert (summary["task"], summary["label"], summary["features"], summary["train"]) == ("classification", "target",
                                                                                          13, 133)
    meta = json.loads((wine / "dataset.json").read_text())
    assert meta["label"] == "target" and meta["classes"] == [0, 1, 2] and meta["normalize"] is True
    report = validate(str(wine))  # no options needed now: dataset.json names the label
    assert report["success"] and report["data_schema"]["schema_source"] == "dataset.json"
    assert report["schema"] == meta["schema"] | {"kind": "tabular"}

    # Pinning is for tightening: a stricter bound in the file fails the split that breaks it.
    train = pq.read_table(wine / "train").to_pandas()
    col = next(c for c in meta["schema"]["columns"] if c["name"] == "alcohol")
    col["max"] = float(train.alcohol.quantile(0.5))
    (wine / "dataset.json").write_text(json.dumps(meta))
    failures = _gate_failures(wine, DataOptions())
    assert any(f.startswith("train: expect_column_max_to_be_between(alcohol)") for f in failures), failures

    again = _cli("describe-data", str(wine), "--label-column", "target")
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr
