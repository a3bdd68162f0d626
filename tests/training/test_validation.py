import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.datasets import make_teacher_dataset
from training.validation import DataValidationError, validate


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    make_teacher_dataset(root, n_train=2_000, n_val=500, seed=1)
    return root


def _rewrite(src, dst, split, change):
    shutil.copytree(src, dst)
    path = dst / split / "part-00000.parquet"
    df = pq.read_table(path).to_pandas()
    changed = change(df)
    df = df if changed is None else changed
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    return dst


def test_clean_dataset_passes(clean):
    report = validate(str(clean))
    assert report["success"] and report["failures"] == []
    assert report["rows"] == {"train": 2000, "validation": 500}
    assert len(report["fingerprint"]) == 64


def test_nulls_and_out_of_range_labels_are_named(clean, tmp_path):
    def corrupt(df):
        df.loc[:9, "f3"] = np.nan
        df.loc[20:24, "label"] = 7

    bad = _rewrite(clean, tmp_path / "bad", "train", corrupt)
    with pytest.raises(DataValidationError) as err:
        validate(str(bad))
    msg = str(err.value)
    assert "train: expect_column_values_to_not_be_null(f3): 10 bad values" in msg
    assert "train: expect_column_values_to_be_in_set(label): 5 bad values, e.g. [7, 7, 7]" in msg
    assert "validation:" not in msg  # the clean split is not blamed
    assert not err.value.report["success"]


def test_missing_column_is_named(clean, tmp_path):
    bad = _rewrite(clean, tmp_path / "bad", "validation", lambda df: df.drop(columns=["f0"]))
    with pytest.raises(DataValidationError, match=r"validation: expect_table_columns_to_match_set"):
        validate(str(bad))


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(DataValidationError, match="dataset.json.*make-data"):
        validate(str(tmp_path / "nowhere"))
