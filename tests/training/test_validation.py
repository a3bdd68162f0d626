"""The data gate on real Parquet files: a clean dataset passes, and every kind of bad data the gate
exists for (each generated here) fails with a line that names the split, the column and the problem."""

import hashlib
import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.data.synthetic import make_teacher_dataset
from training.data.gate import DataValidationError, schema_from_meta, validate


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    make_teacher_dataset(root, n_train=2_000, n_val=500, seed=1)
    return root


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(src, dst, split, change):
    _copy(src, dst)
    path = dst / split / "part-00000.parquet"
    df = pq.read_table(path).to_pandas()
    changed = change(df)
    df = df if changed is None else changed
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    return dst


def _failures(root, **kw) -> list[str]:
    with pytest.raises(DataValidationError) as err:
        validate(str(root), **kw)
    report = err.value.report
    assert report["success"] is False
    assert str(err.value).splitlines()[1:] == [f"  - {f}" for f in report["failures"]], "one readable line per problem"
    return report["failures"]


def test_clean_dataset_passes_with_fingerprint(clean):
    report = validate(str(clean))
    assert report["success"] and report["failures"] == []
    assert report["rows"] == {"train": 2000, "validation": 500}
    files = {f["path"]: f for f in report["files"]}
    assert set(files) == {"train/part-00000.parquet", "validation/part-00000.parquet"}
    for path, f in files.items():
        assert f["sha256"] == hashlib.sha256((clean / path).read_bytes()).hexdigest()
    assert len(report["fingerprint"]) == 64
    assert report["schema"]["class_fraction"] == [0.025, 0.9] and report["schema"]["label"] == "label"


def test_fingerprint_changes_with_the_data(clean, tmp_path):
    changed = _rewrite(clean, tmp_path / "c", "validation", lambda df: df.iloc[1:])
    assert validate(str(changed))["fingerprint"] != validate(str(clean))["fingerprint"]


def test_nulls_and_out_of_range_labels_are_named(clean, tmp_path):
    def corrupt(df):
        df.loc[:9, "f3"] = np.nan
        df.loc[20:24, "label"] = 7

    failures = _failures(_rewrite(clean, tmp_path / "bad", "train", corrupt))
    assert "train: expect_column_values_to_not_be_null(f3): 10 bad values" in failures
    assert "train: expect_column_values_to_be_in_set(label): 5 values outside the set ([0, 1, 2, 3]): [7]" in failures
    assert not any(f.startswith("validation:") for f in failures)  # the clean split is not blamed


def test_nulls_in_the_label_column(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "validation", lambda df: df.assign(label=df["label"].astype("Int64").mask(df.index < 3)))
    assert _failures(bad) == [
        "validation: expect_column_values_to_not_be_null(label): 3 bad values"]


@pytest.mark.parametrize("value, check", [(np.inf, "max"), (-np.inf, "min")])
def test_inf_is_named(clean, tmp_path, value, check):
    def corrupt(df):
        df.loc[:2, "f2"] = value

    failures = _failures(_rewrite(clean, tmp_path / "bad", "train", corrupt))
    assert failures == [f"train: expect_column_{check}_to_be_between(f2): observed {'-' if value < 0 else ''}inf, "
                        "allowed {'min_value': -6.0, 'max_value': 6.0}"]


def test_feature_out_of_declared_range(clean, tmp_path):
    def corrupt(df):
        df.loc[5, "f7"] = 40.0

    assert _failures(_rewrite(clean, tmp_path / "bad", "train", corrupt)) == [
        "train: expect_column_max_to_be_between(f7): observed 40.0, allowed {'min_value': -6.0, 'max_value': 6.0}"]


def test_missing_column_is_named_once(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "validation", lambda df: df.drop(columns=["f0"]))
    assert _failures(bad) == ["validation: expect_table_columns_to_match_set: missing ['f0']"]


def test_renamed_column_is_named(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "train", lambda df: df.rename(columns={"f0": "feature_0"}))
    assert _failures(bad) == ["train: expect_table_columns_to_match_set: missing ['f0'], unexpected ['feature_0']"]


@pytest.mark.parametrize("column, cast, observed, expected", [
    ("label", "float64", "float64", "int"),
    ("f4", "str", "str", "float"),
])
def test_wrong_dtype_is_named(clean, tmp_path, column, cast, observed, expected):
    bad = _rewrite(clean, tmp_path / "bad", "train", lambda df: df.assign(**{column: df[column].astype(cast)}))
    assert _failures(bad) == [
        f"train: expect_column_values_to_be_in_type_list({column}): observed dtype {observed}, expected {expected}"]


def test_zero_byte_file(clean, tmp_path):
    bad = _copy(clean, tmp_path / "bad")
    (bad / "train" / "part-00000.parquet").write_bytes(b"")
    [line] = _failures(bad)
    assert line.startswith("train: cannot read Parquet") and "0 bytes" in line


def test_file_with_zero_rows(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "validation", lambda df: df.iloc[:0])
    assert _failures(bad) == ["validation: expect_table_row_count_to_be_between: observed 0, allowed {'min_value': 100}"]


def test_too_few_rows(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "validation", lambda df: df.iloc[:50])
    assert "validation: expect_table_row_count_to_be_between: observed 50, allowed {'min_value': 100}" in _failures(bad)


def test_truncated_parquet(clean, tmp_path):
    bad = _copy(clean, tmp_path / "bad")
    path = bad / "train" / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    [line] = _failures(bad)
    assert line.startswith("train: cannot read Parquet (ArrowInvalid") and "corrupted" in line


def test_corrupt_parquet_footer(clean, tmp_path):
    bad = _copy(clean, tmp_path / "bad")
    path = bad / "validation" / "part-00000.parquet"
    data = bytearray(path.read_bytes())
    data[-200:-8] = b"\xff" * 192  # the footer metadata, magic bytes intact
    path.write_bytes(bytes(data))
    [line] = _failures(bad)
    assert line.startswith("validation: cannot read Parquet")


def test_missing_dataset_is_a_clear_error(tmp_path):
    assert _failures(tmp_path / "nowhere") == [
        f"config field 'dataset_uri': {tmp_path / 'nowhere'} does not exist. Fix: give an existing folder, Parquet "
        "file or s3:// prefix"]


def test_missing_split_folder(clean, tmp_path):
    bad = _copy(clean, tmp_path / "bad")
    shutil.rmtree(bad / "validation")
    assert _failures(bad) == [f"validation: no Parquet files under {bad / 'validation'} (nor {bad / 'val'})"]


def test_duplicate_rows_beyond_the_bound(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "train", lambda df: pd.concat([df, df.iloc[:100]], ignore_index=True))
    assert _failures(bad) == [
        "train: expect_rows_to_be_unique(all columns): 200 of 2100 rows are duplicated (9.52%, allowed 1.00%)"]


def test_duplicate_rows_within_the_bound_pass(clean, tmp_path):
    ok = _rewrite(clean, tmp_path / "ok", "train", lambda df: pd.concat([df, df.iloc[:5]], ignore_index=True))
    assert validate(str(ok))["success"]  # 10 of 2005 rows (0.5%) are within the 1% bound


def test_class_imbalance_is_named(clean, tmp_path):
    def skew(df):
        return df.assign(label=np.where(np.arange(len(df)) < 1_950, 0, df["label"]))

    [line] = _failures(_rewrite(clean, tmp_path / "bad", "train", skew))
    assert line.startswith("train: expect_column_class_fractions_to_be_between(label): class shares {'0': 0.9")
    assert "outside [0.025, 0.9]" in line


def test_explicit_schema_for_another_kind(tmp_path):
    """A kind's schema comes from dataset.json: here token sequences with an explicit schema section."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 400), ("validation", 120)):
        (tmp_path / split).mkdir()
        seq = rng.integers(0, 50, size=(n, 9))
        pq.write_table(pa.table({f"t{i}": seq[:, i] for i in range(9)}), tmp_path / split / "part-00000.parquet")
    schema = {"columns": [{"name": f"t{i}", "dtype": "int", "min": 0, "max": 49} for i in range(9)],
              "min_rows": 100, "max_duplicate_fraction": 0.0}
    (tmp_path / "dataset.json").write_text(json.dumps({"kind": "tokens", "schema": schema}))
    assert validate(str(tmp_path))["success"]

    path = tmp_path / "validation" / "part-00000.parquet"
    df = pq.read_table(path).to_pandas()
    df.loc[3, "t5"] = 50  # a token id past the vocabulary
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    assert _failures(tmp_path) == [
        "validation: expect_column_max_to_be_between(t5): observed 50, allowed {'min_value': 0.0, 'max_value': 49.0}"]


def test_derived_schema_for_tokens_without_label():
    schema = schema_from_meta({"kind": "tokens", "features": ["t0", "t1"], "feature_dtype": "int",
                               "feature_range": [0, 15], "label": None, "n_classes": 16})
    assert [(c.name, c.dtype, c.min, c.max) for c in schema.columns] == [("t0", "int", 0, 15), ("t1", "int", 0, 15)]
    assert schema.label is None and schema.class_fraction is None


@pytest.mark.parametrize("meta, problem", [
    ({"kind": "audio"}, "kind 'audio' has no 'schema' section"),
    ({"kind": "tabular", "features": ["a"]}, "kind 'tabular' needs the field 'feature_range'"),
    ({"kind": "x", "schema": {"columns": [{"name": "a", "dtype": "floaty"}]}}, "dtype 'floaty' is unknown"),
    ({"kind": "x", "schema": {"columns": [{"name": "a", "dtype": "int"}], "label": "b"}}, "schema.label 'b' is not one of"),
])
def test_unusable_schema_is_refused(tmp_path, meta, problem):
    (tmp_path / "dataset.json").write_text(json.dumps(meta))
    [line] = _failures(tmp_path)
    assert line.startswith("dataset.json: ") and problem in line


def test_data_docs_are_built_with_gx(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "train", lambda df: df.assign(f1=df["f1"].where(df.index >= 4)))
    with pytest.raises(DataValidationError) as err:
        validate(str(bad), docs_dir=tmp_path / "docs")
    index = tmp_path / "docs" / "index.html"
    assert err.value.report["data_docs"] == str(index) and index.is_file()
    pages = sorted((tmp_path / "docs" / "validations").rglob("*.html"))
    assert len(pages) == 2, pages  # one validation page per split
    train_page = next(p.read_text() for p in pages if "train" in str(p))
    assert "f1" in train_page and "values must never be null" in train_page.lower()


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_cli_uses_the_schema_minimum_and_builds_docs(clean, tmp_path):
    """`python -m training validate`: exit 2 with one line per problem; the schema's min_rows holds
    unless --min-rows overrides it; --docs-dir writes GX Data Docs."""
    import subprocess
    import sys

    data = _copy(clean, tmp_path / "d")
    meta = json.loads((data / "dataset.json").read_text())
    meta["schema"] = {**schema_from_meta(meta).to_dict(), "min_rows": 1000}
    (data / "dataset.json").write_text(json.dumps(meta))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "training", "validate", "--dataset-uri", str(data), *args],
                              capture_output=True, text=True, timeout=300)

    bad = cli("--docs-dir", str(tmp_path / "docs"))
    assert bad.returncode == 2
    assert "  - validation: expect_table_row_count_to_be_between: observed 500, allowed {'min_value': 1000}" in bad.stderr
    assert (tmp_path / "docs" / "index.html").is_file()
    assert validate(str(data), min_rows=400)["success"]  # what --min-rows 400 passes on


def test_a_passed_verdict_is_reused_until_the_data_schema_or_suite_changes(clean, tmp_path, monkeypatch):
    """gate_cached: the second gate on the same bytes returns the first verdict (and its Data
    Docs) without running GX; new data, a changed dataset.json, other data options or another
    min_rows run it again; a failed verdict is never kept."""
    import training.data.gate as v
    from training.data.options import DataOptions
    from training.data.gate import gate_cached

    runs = []
    real_gate = v.gate
    monkeypatch.setattr(v, "gate", lambda *a, **kw: runs.append(a) or real_gate(*a, **kw))
    data, cache = _copy(clean, tmp_path / "d"), tmp_path / "cache"

    first, _ = gate_cached(str(data), cache_dir=cache, docs_dir=tmp_path / "docs1")
    again, ds = gate_cached(str(data), cache_dir=cache, docs_dir=tmp_path / "docs2")
    assert len(runs) == 1 and "cached_from" not in first
    assert again["cached_from"]["validated_unix"] > 0 and again["cached_from"]["dataset_uri"] == str(data)
    assert {k: again[k] for k in ("success", "rows", "files", "fingerprint", "schema")} == \
        {k: first[k] for k in ("success", "rows", "files", "fingerprint", "schema")}
    assert ds.fingerprint == first["fingerprint"], "the opened dataset comes back with the kept verdict"
    assert again["data_docs"] == str(tmp_path / "docs2" / "index.html") and (tmp_path / "docs2" / "index.html").is_file()
    assert len(sorted((tmp_path / "docs2" / "validations").rglob("*.html"))) == 2  # the first run's pages

    assert gate_cached(str(data), cache_dir=cache, min_rows=400)[0]["success"] and len(runs) == 2
    gate_cached(str(data), cache_dir=cache, options=DataOptions(task="classification"))
    assert len(runs) == 3, "other data options: another verdict"
    meta = json.loads((data / "dataset.json").read_text())
    (data / "dataset.json").write_text(json.dumps({**meta, "label_noise": 0.2}))  # the schema's file changed
    gate_cached(str(data), cache_dir=cache)
    assert len(runs) == 4

    bad = _rewrite(clean, tmp_path / "bad", "train", lambda df: df.assign(f1=df["f1"].where(df.index >= 4)))
    for _ in range(2):
        with pytest.raises(DataValidationError):
            gate_cached(str(bad), cache_dir=cache)
    assert len(runs) == 6, "a failed verdict is not kept: the gate runs each time"
