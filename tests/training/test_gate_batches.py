"""The data gate in batches (data larger than memory: one pass over the Parquet row groups) reaches
the verdict the whole-split gate reaches: the same data passes, the same bad data fails the same
expectations, and the whole-split ones (row count, duplicates across batches, class shares) read
exactly as they do on whole splits."""

import numpy as np
import pandas as pd
import pytest

from tests.training.test_validation import _copy, _rewrite, clean  # noqa: F401 (a fixture)
from training.data.gate import DataValidationError, validate
from training.data.options import DataOptions

ROWS = 700  # train's 2,000 rows in 3 batches


def _verdict(root, **kw):
    try:
        return validate(str(root), **kw)
    except DataValidationError as e:
        return e.report


def test_a_clean_dataset_passes_in_batches_with_what_the_whole_gate_records(clean):  # noqa: F811
    whole, batched = _verdict(clean), _verdict(clean, batch_rows=ROWS)
    assert whole["success"] and batched["success"]
    assert batched["rows"] == whole["rows"] and batched["fingerprint"] == whole["fingerprint"]
    assert batched["batched"]["batches"] == {"train": 3, "validation": 1} and "batched" not in whole
    assert batched["data_schema"]["classes"] == whole["data_schema"]["classes"]
    for b, w in zip(batched["data_schema"]["train_columns"], whole["data_schema"]["train_columns"]):
        assert (b["name"], b["dtype"], b["missing"]) == (w["name"], w["dtype"], w["missing"])
        if "min" in w:
            assert (b["min"], b["max"]) == pytest.approx((w["min"], w["max"]))
            assert (b["mean"], b["std"]) == pytest.approx((w["mean"], w["std"]), rel=1e-3, abs=1e-6)


def _nulls_and_labels(df):
    df.loc[:9, "f3"] = np.nan
    df.loc[1500:1504, "label"] = 7  # in the third batch
    df.loc[800, "f2"] = np.inf


def _duplicates(df):  # copies of the first batch's rows at the end: duplicates across batches
    return pd.concat([df, df.iloc[:100]], ignore_index=True)


def _skew(df):
    return df.assign(label=np.where(np.arange(len(df)) < 1_950, 0, df["label"]))


@pytest.mark.parametrize("split, change", [("train", _nulls_and_labels), ("train", _duplicates),
                                           ("train", _skew), ("validation", lambda df: df.iloc[:50])])
def test_bad_data_fails_the_same_expectations_in_batches(clean, tmp_path, split, change):  # noqa: F811
    bad = _rewrite(clean, tmp_path / "bad", split, change)
    whole, batched = _verdict(bad), _verdict(bad, batch_rows=ROWS)
    assert not whole["success"] and not batched["success"]
    key = lambda r: sorted((f["line"].split(":")[0], f.get("expectation") or f["line"].split(": ")[1].split("(")[0],
                            f.get("column")) for f in r["failed_expectations"])
    assert [k[:2] for k in key(batched)] == [k[:2] for k in key(whole)]
    whole_split = ("expect_rows_to_be_unique", "expect_column_class_fractions", "expect_table_row_count")
    for line in whole["failures"]:  # checked on the pass's totals: worded exactly as on whole splits
        if any(w in line for w in whole_split):
            assert line in batched["failures"] or line.split(": class shares")[0] in " ".join(batched["failures"])


def test_a_batch_failure_says_where_it_was_first_seen(clean, tmp_path):  # noqa: F811
    bad = _rewrite(clean, tmp_path / "bad", "train", _nulls_and_labels)
    lines = _verdict(bad, batch_rows=ROWS)["failures"]
    assert "train: expect_column_values_to_be_in_set(label): 5 values outside the set ([0, 1, 2, 3]): [7] (first in rows 1400-1999; " \
           "1 of 3 batches)" in lines
    assert "train: expect_column_values_to_not_be_null(f3): 10 bad values (first in rows 0-699; 1 of 3 batches)" in lines


def test_a_truncated_file_fails_in_batches(clean, tmp_path):  # noqa: F811
    bad = _copy(clean, tmp_path / "bad")
    path = bad / "train" / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert any(line.startswith("train: cannot read Parquet") for line in _verdict(bad, batch_rows=ROWS)["failures"])


@pytest.mark.parametrize("parts", [1, 4])
def test_duplicated_rows_counted_as_np_unique_counts_them(parts):
    from training.data.batches import Totals

    rng = np.random.default_rng(0)
    h = rng.integers(0, 2_000, size=5_000).astype(np.uint64)  # groups of 1 to ~10 equal hashes
    _, inverse, counts = np.unique(h, return_inverse=True, return_counts=True)
    expected = int((counts[inverse] > 1).sum())
    t = Totals(hashed=["x"], label=None, capacity=len(h) // 3)  # grows past what the footers said
    for c in np.array_split(h, parts):
        t.add_hashes(pd.Series(c).to_numpy())  # read-only, as pandas hands them
    assert 0 < expected < len(h) and t.duplicated() == expected and t.duplicated() == expected
    assert Totals(hashed=["x"], label=None).duplicated() == 0


@pytest.mark.slow
def test_the_batched_gate_peak_grows_by_the_row_hashes_only(tmp_path):
    """The batched pass over 10x the rows (same batches, same row groups) peaks higher by the 8 bytes
    a row of hashes it keeps, plus a margin: each gate in a fresh process, its peak resident set."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    from training.data.synthetic import make_teacher_dataset

    src = tmp_path / "src"
    make_teacher_dataset(src, n_train=1_000_000, n_val=2_000, seed=0)
    train = pq.read_table(src / "train" / "part-00000.parquet")
    peaks, rows = {}, {"1x": 100_000, "10x": 1_000_000}
    for name, n in rows.items():
        root = tmp_path / name
        shutil.copytree(src / "validation", root / "validation")
        shutil.copy(src / "dataset.json", root / "dataset.json")
        (root / "train").mkdir()
        pq.write_table(train.slice(0, n), root / "train" / "part-00000.parquet", row_group_size=50_000)
        # VmHWM, not ru_maxrss: a child's ru_maxrss starts from the parent's (here pytest's) peak.
        code = ("import json; from training.data.gate import validate; "
                f"r = validate({str(root)!r}, batch_rows=50_000); print(json.dumps({{'rows': r['rows'], "
                "'batches': r['batched']['batches'], 'peak': next(int(v.split()[1]) * 1024 for v in "
                "open('/proc/self/status') if v.startswith('VmHWM'))}))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[2])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert r["rows"]["train"] == n and r["batches"]["train"] == n // 50_000
        peaks[name] = r["peak"]
    hashes = 8 * (rows["10x"] - rows["1x"])
    growth = peaks["10x"] - peaks["1x"]
    # Before: np.unique over the hashes and allocator pages kept between batches, ~70 MiB here.
    assert growth < hashes + (24 << 20), f"peak grew by {growth / 2**20:.0f} MiB from 1x to 10x ({peaks})"


def test_a_table_without_dataset_json_is_inferred_and_checked_in_batches_as_whole(clean, tmp_path):  # noqa: F811
    """No description to read: the batched gate infers the schema from train's profile (a pass over
    row groups) and reaches the whole gate's schema and verdict, on clean data and on bad data."""
    plain = _copy(clean, tmp_path / "plain")
    (plain / "dataset.json").unlink()
    options = DataOptions(label_column="label")
    whole, batched = _verdict(plain, options=options), _verdict(plain, options=options, batch_rows=ROWS)
    assert whole["success"] and batched["success"]
    assert batched["batched"]["batches"] == {"train": 3, "validation": 1} and "batched" not in whole
    assert batched["schema"] == whole["schema"]
    assert batched["data_schema"]["schema_source"] == "inferred from the train split"
    assert batched["data_schema"]["description"] == whole["data_schema"]["description"]
    # Validation values far outside train's range fail the same expectation both ways.
    bad = _rewrite(plain, tmp_path / "bad", "validation", lambda df: df.assign(f0=df["f0"] * 1000))
    w, b = _verdict(bad, options=options), _verdict(bad, options=options, batch_rows=ROWS)
    assert not w["success"] and not b["success"]
    assert {(f["split"], f["expectation"], f["column"]) for f in b["failed_expectations"]} == \
        {(f["split"], f["expectation"], f["column"]) for f in w["failed_expectations"]}
