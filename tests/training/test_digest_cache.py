"""The machine's cache of verified digests (training/util.py ``sha256_cached``): a second open of a
dataset, of its S3 copies or of token shards reads no data file again; a file rewritten in place
(same size, its mtime put back) is hashed again and refused; the ranks of a machine opening at
once hash each file once. Real files, real hashing: ``sha256_file`` is only counted."""

from __future__ import annotations

import multiprocessing
import os
import time

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training import util
from training.config.fields import ConfigError
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.sources import cache_dir
from training.data.tokenizer import resolve
from training.data.tokens import build, open_shards
from training.store import StoreError

OPTIONS = DataOptions(label_column="y")
FILES = ("train/part-0.parquet", "train/part-1.parquet", "validation/part-0.parquet")


def _old_enough():
    """Past the window in which a just-written file is not recorded (its clock tick could be shared)."""
    time.sleep(util.RACY_NS / 1e9 + 0.05)


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "machine"))
    monkeypatch.delenv(util.DIGEST_CACHE_ENV, raising=False)
    root = tmp_path / "data"
    for i, name in enumerate(FILES):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        pq.write_table(pa.table({"x": rng.normal(size=200), "y": rng.integers(0, 3, size=200)}), root / name)
    _old_enough()
    return root


@pytest.fixture
def reads(monkeypatch):
    """The paths ``sha256_file`` reads (wrapped, not replaced)."""
    seen: list[str] = []
    real = util.sha256_file

    def counted(path, *a, **kw):
        seen.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(util, "sha256_file", counted)
    return seen


def _rewrite_in_place(path):
    """Other bytes, same size, the old mtime put back: only ctime tells."""
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(raw)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_second_open_reads_no_data_file_and_a_rewrite_is_refused(data, reads):
    first = open_dataset(data, OPTIONS)
    assert sorted(reads) == sorted(str(data / n) for n in FILES)
    hits = util.digest_counts["hit"]
    reads.clear()
    again = open_dataset(data, OPTIONS, expect_fingerprint=first.fingerprint)
    assert reads == [] and util.digest_counts["hit"] == hits + len(FILES)
    assert again.fingerprint == first.fingerprint and again.table("train").num_rows == 400

    _rewrite_in_place(data / FILES[2])
    with pytest.raises(ConfigError) as err:
        open_dataset(data, OPTIONS, expect_fingerprint=first.fingerprint)
    assert err.value.field == "dataset_fingerprint" and "changed after the data gate passed it" in str(err.value)
    assert reads == [str(data / FILES[2])], "only the rewritten file is read again"


def test_replaced_files_and_the_switch_off_hash_again(data, reads, monkeypatch):
    first = open_dataset(data, OPTIONS).fingerprint
    other = data / "other.parquet"
    pq.write_table(pa.table({"x": [1.0] * 200, "y": [0] * 200}), other)
    os.replace(other, data / FILES[0])  # a new inode under the same name
    reads.clear()
    assert open_dataset(data, OPTIONS).fingerprint != first
    assert reads == [str(data / FILES[0])]
    monkeypatch.setenv(util.DIGEST_CACHE_ENV, "off")
    reads.clear()
    open_dataset(data, OPTIONS)
    assert len(reads) == len(FILES)


def _open_counting(root: str) -> int:
    from training import util as u
    from training.data.dataset import open_dataset as od

    od(root, DataOptions(label_column="y"))
    return u.digest_counts["hashed"]


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_ranks_opening_at_once_hash_each_file_once(data):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        hashed = pool.map(_open_counting, [str(data)] * 4)
    assert sum(hashed) == len(FILES), hashed


def test_s3_copies_are_not_read_again_while_unchanged(s3_server, data, reads, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINING_DATA_CACHE", str(tmp_path / "s3-cache"))
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="digests")
    for name in FILES:
        s3.upload_file(str(data / name), "digests", f"set/{name}")
    first = open_dataset("s3://digests/set", OPTIONS).fingerprint
    assert first == open_dataset(data, OPTIONS).fingerprint
    _old_enough()
    open_dataset("s3://digests/set", OPTIONS)  # hashed once more, now old enough to be kept
    reads.clear()
    assert open_dataset("s3://digests/set", OPTIONS).fingerprint == first
    assert reads == []
    # A copy damaged in place (same size and mtime) is hashed again and fetched again.
    victim = sorted(cache_dir().rglob("*.parquet"))[0]
    _rewrite_in_place(victim)
    assert open_dataset("s3://digests/set", OPTIONS).fingerprint == first
    assert str(victim) in reads


def test_token_shards_changed_after_the_tokenize_step_are_refused(data, reads, tmp_path):
    docs = pa.table({"text": [f"document {i}: " + "some words to tokenize " * 8 for i in range(60)]})
    text = tmp_path / "text"
    for split in ("train", "validation"):
        (text / split).mkdir(parents=True)
        pq.write_table(docs, text / split / "part-0.parquet")
    ds = open_dataset(text, DataOptions(text_column="text"))
    made = build(ds, text_column="text", tokenizer=resolve("bytes", train_documents=lambda: []), seq_len=16,
                 store_uri=str(tmp_path / "store"))
    _old_enough()
    open_shards(made.uri)
    reads.clear()
    shards = open_shards(made.uri)
    assert reads == [] and shards.split("validation").features.shape[1] == 17
    _rewrite_in_place(tmp_path / "store" / "tokens" / made.key / "train.npy")
    with pytest.raises(StoreError, match="does not match its manifest sha256"):
        open_shards(made.uri)
