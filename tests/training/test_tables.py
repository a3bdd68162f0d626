"""Data as people have it: plain Parquet in three layouts, locally and on S3 (moto's server over HTTP
on 127.0.0.1), no metadata file; the deterministic split of one table; the S3 cache; the
fingerprint of what was read, and the ranks refusing data that changed after the gate."""

from __future__ import annotations

import hashlib
import json

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.data.dataset import open_dataset
from training.config.fields import ConfigError
from training.data.options import DataOptions
from training.data.sources import cache_dir, discover
from training.data.split import validation_rows


def _table(n: int, seed: int = 0, start: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"id": np.arange(start, start + n), "x": rng.normal(size=n), "y": rng.integers(0, 3, size=n)})


def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


OPTIONS = DataOptions(label_column="y")


@pytest.mark.parametrize("files, style", [
    ({"train/part-0.parquet": (0, 150), "train/part-1.parquet": (150, 150), "validation/part-0.parquet": (600, 100)},
     "folders"),
    ({"train/a/b/p.parquet": (0, 300), "val/p.parquet": (300, 100), "test/p.parquet": (400, 50)}, "folders"),
    ({"training/p.parquet": (0, 300), "valid/p.parquet": (300, 100)}, "folders"),
    ({"train.parquet": (0, 300), "validation.parquet": (300, 100), "test.parquet": (400, 50)}, "prefixed"),
    ({"train-00000.parquet": (0, 200), "train-00001.parquet": (200, 100), "val_0.parquet": (300, 100)}, "prefixed"),
])
def test_split_layouts_without_metadata(tmp_path, files, style):
    for name, (start, n) in files.items():
        _write(tmp_path / name, _table(n, seed=start, start=start))
    layout = discover(str(tmp_path))
    assert layout.style == style and layout.problems == []
    ds = open_dataset(tmp_path, OPTIONS)
    train, val = ds.table("train"), ds.table("validation")
    assert train.num_rows == 300 and val.num_rows == 100
    assert set(train.column("id").to_pylist()).isdisjoint(val.column("id").to_pylist())
    assert [i for i in layout.ignored] == [n for n in files if n.startswith("test")]  # read by nobody, said so
    # The fingerprint: every file read, by its path under the root and its sha256.
    read = sorted(n for n in files if not n.startswith("test"))
    h = hashlib.sha256()
    for name in read:
        h.update(f"{name}\0{hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}\n".encode())
    assert ds.fingerprint == h.hexdigest()


def test_one_table_is_split_by_validation_fraction(tmp_path):
    _write(tmp_path / "all.parquet", _table(5000))
    for uri in (tmp_path, tmp_path / "all.parquet"):  # a folder of one part, or the file itself
        ds = open_dataset(uri, OPTIONS)
        assert ds.layout.style == "one table"
        train, val = ds.table("train"), ds.table("validation")
        assert train.num_rows + val.num_rows == 5000
        assert 0.17 < val.num_rows / 5000 < 0.23  # 0.2 in expectation
        assert set(train.column("id").to_pylist()).isdisjoint(val.column("id").to_pylist())
    other = open_dataset(tmp_path, DataOptions(label_column="y", validation_fraction=0.5, split_seed=7))
    assert 0.46 < other.table("validation").num_rows / 5000 < 0.54


def test_the_split_is_stable_when_rows_are_appended_and_keeps_duplicates_together(tmp_path):
    first = _table(2000, seed=1)
    val = validation_rows(first, 0.2, seed=3)
    # New rows appended, in another part file, in a shuffled order: old rows keep their side.
    more = pa.concat_tables([_table(1000, seed=2, start=2000), first.take(np.random.default_rng(0).permutation(2000))])
    by_id = dict(zip(more.column("id").to_pylist(), validation_rows(more, 0.2, seed=3).tolist()))
    assert [by_id[i] for i in range(2000)] == val.tolist()
    # Exact copies of a row always land on the same side (no row in both train and validation).
    doubled = pa.concat_tables([first, first])
    sides = validation_rows(doubled, 0.2, seed=3)
    assert (sides[:2000] == sides[2000:]).all()
    # Another seed, another split; the same seed, the same split.
    assert (validation_rows(first, 0.2, seed=4) != val).any()
    assert (validation_rows(first, 0.2, seed=3) == val).all()


@pytest.mark.parametrize("files, problem", [
    ({"train/p.parquet": 100}, "validation: no Parquet files under {root}/validation (nor {root}/val)"),
    ({"validation.parquet": 100}, "train: no Parquet file named train* beside the val* files"),
    ({"notes.txt": 0}, "no Parquet files under {root}"),
])
def test_unusable_layouts_say_what_to_give(tmp_path, files, problem):
    for name, n in files.items():
        if name.endswith(".parquet"):
            _write(tmp_path / name, _table(n))
        else:
            (tmp_path / name).write_text("x")
    with pytest.raises(ConfigError) as err:
        open_dataset(tmp_path, OPTIONS)
    assert err.value.field == "dataset_uri"
    assert problem.format(root=tmp_path) in str(err.value)
    assert "train/ and validation/ (or val/) sub-folders" in str(err.value)


def test_a_missing_dataset_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=f"'dataset_uri': {tmp_path / 'nope'} does not exist"):
        open_dataset(tmp_path / "nope")


def test_data_changed_after_the_gate_is_refused(tmp_path):
    _write(tmp_path / "train.parquet", _table(300))
    _write(tmp_path / "val.parquet", _table(100, seed=5, start=300))
    gate = open_dataset(tmp_path, OPTIONS).fingerprint
    assert open_dataset(tmp_path, OPTIONS, expect_fingerprint=gate).fingerprint == gate
    _write(tmp_path / "val.parquet", _table(101, seed=5, start=300))  # someone rewrote a file
    with pytest.raises(ConfigError) as err:
        open_dataset(tmp_path, OPTIONS, expect_fingerprint=gate)
    assert err.value.field == "dataset_fingerprint" and "changed after the data gate passed it" in str(err.value)


def test_s3_layouts_read_through_a_verified_cache(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_DATA_CACHE", str(tmp_path / "cache"))
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="data")
    local = tmp_path / "local"
    _write(local / "train" / "part-0.parquet", _table(300))
    _write(local / "val" / "part-0.parquet", _table(100, seed=5, start=300))
    for p in sorted(local.rglob("*.parquet")):
        s3.upload_file(str(p), "data", f"team/set/{p.relative_to(local).as_posix()}")
    s3.put_object(Bucket="data", Key="team/set/_SUCCESS", Body=b"")

    ds = open_dataset("s3://data/team/set", OPTIONS)
    assert ds.layout.style == "folders"
    assert ds.fingerprint == open_dataset(local, OPTIONS).fingerprint  # the same bytes, the same names
    assert ds.table("train").equals(open_dataset(local, OPTIONS).table("train"))
    cached = sorted(cache_dir().rglob("*.parquet"))
    assert len(cached) == 2 and cache_dir() == tmp_path / "cache"

    # A second open reads the cache: no object is downloaded again (the copies keep their inode).
    inodes = {p: p.stat().st_ino for p in cached}
    again = open_dataset("s3://data/team/set", OPTIONS)
    assert {p: p.stat().st_ino for p in sorted(cache_dir().rglob("*.parquet"))} == inodes
    assert again.fingerprint == ds.fingerprint
    assert json.loads(json.dumps(again.layout.summary(OPTIONS)))["files"] == {"train": ["train/part-0.parquet"],
                                                                             "validation": ["val/part-0.parquet"]}

    # A damaged copy in the cache (same size, other bytes) no longer hashes to the sha256 kept
    # with it: it is fetched again, and what is read is what the bucket holds.
    victim = cached[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert open_dataset("s3://data/team/set", OPTIONS).fingerprint == ds.fingerprint
    assert victim.read_bytes() != bytes(data)

    # A changed object has a new ETag: downloaded anew, and the fingerprint follows the bytes read.
    changed = local / "val" / "part-0.parquet"
    _write(changed, _table(120, seed=6, start=300))
    s3.upload_file(str(changed), "data", "team/set/val/part-0.parquet")
    after = open_dataset("s3://data/team/set", OPTIONS)
    assert after.fingerprint == open_dataset(local, OPTIONS).fingerprint != ds.fingerprint
    assert after.table("validation").num_rows == 120

    # One object as the whole table; a missing bucket names the field.
    s3.upload_file(str(changed), "data", "one/table.parquet")
    one = open_dataset("s3://data/one/table.parquet", OPTIONS)
    assert one.layout.style == "one table" and one.table("train").num_rows + one.table("validation").num_rows == 120
    with pytest.raises(ConfigError, match="'dataset_uri': bucket 'nobucket' does not exist"):
        open_dataset("s3://nobucket/x", OPTIONS)
    with pytest.raises(ConfigError, match="s3://data/empty holds no objects"):
        open_dataset("s3://data/empty", OPTIONS)


