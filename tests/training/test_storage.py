"""The checkpoint store on file:// (fast, every rule) and on a real S3 API (moto over HTTP)."""

import json

import boto3
import pytest

from tests.conftest import local_checkpoint
from training.config.fields import ConfigError
from training.checkpoint.commit import MANIFEST, fetch_checkpoint, upload_checkpoint
from training.store import open_store
from training.store.base import StoreError
from training.util import sha256_file


def _fake_checkpoint(root, step, payload=b"weights"):
    return local_checkpoint(root, step, {"__0_0.distcp": payload * 1000, "model.safetensors": payload[::-1] * 10})


def test_commit_layout_and_manifest(tmp_path):
    ck = _fake_checkpoint(tmp_path / "local", 300)
    c = upload_checkpoint(ck, (tmp_path / "store").as_uri(), experiment="exp", run_id="run1")
    base = tmp_path / "store" / "exp" / "run1"
    manifest = json.loads((base / "step_00000300" / MANIFEST).read_text())
    assert manifest["step"] == 300 and manifest["world_size"] == 2 and manifest["config_hash"] == "abc"
    for f in manifest["files"]:
        assert sha256_file(base / "step_00000300" / f["path"]) == f["sha256"]
    assert json.loads((base / "latest").read_text())["step_dir"] == "step_00000300"
    assert c.uploaded == 2 and c.skipped == 0


def test_reupload_skips_and_never_overwrites(tmp_path):
    store = (tmp_path / "store").as_uri()
    ck = _fake_checkpoint(tmp_path / "local", 5)
    upload_checkpoint(ck, store, experiment="e", run_id="r")
    again = upload_checkpoint(ck, store, experiment="e", run_id="r")
    assert (again.uploaded, again.skipped) == (0, 2)
    other = _fake_checkpoint(tmp_path / "other", 5, payload=b"different")  # the same step, other bytes
    with pytest.raises(StoreError, match="already committed with different content"):
        upload_checkpoint(other, store, experiment="e", run_id="r")


def test_incomplete_or_damaged_local_checkpoint_is_refused(tmp_path):
    ck = _fake_checkpoint(tmp_path / "local", 5)
    (ck / MANIFEST).unlink()
    with pytest.raises(StoreError, match="has no manifest.json: the save was interrupted"):
        upload_checkpoint(ck, (tmp_path / "s").as_uri(), experiment="e", run_id="r")
    ck = _fake_checkpoint(tmp_path / "local2", 6)
    (ck / "model.safetensors").write_bytes(b"changed on the worker's disk")
    with pytest.raises(StoreError, match="step_00000006/model.safetensors has 28 bytes, its manifest says 70"):
        upload_checkpoint(ck, (tmp_path / "s").as_uri(), experiment="e", run_id="r")
    assert not (tmp_path / "s").exists(), "nothing of a damaged checkpoint is published"


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    store = (tmp_path / "store").as_uri()
    for step in (100, 200):
        upload_checkpoint(_fake_checkpoint(tmp_path / "local", step, payload=str(step).encode()), store,
                          experiment="e", run_id="r")
    victim = tmp_path / "store" / "e" / "r" / "step_00000200" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    local, manifest, warnings = fetch_checkpoint(store, experiment="e", run_id="r", dest=tmp_path / "dl")
    assert manifest["step"] == 100 and local.name == "step_00000100"
    assert any("step_00000200" in w and "sha256" in w for w in warnings)


@pytest.mark.parametrize("bad", ["../x", "a/b", ".."])
def test_unsafe_run_ids_are_refused(tmp_path, bad):
    ck = _fake_checkpoint(tmp_path / "local", 1)
    with pytest.raises(ConfigError):
        upload_checkpoint(ck, (tmp_path / "s").as_uri(), experiment="e", run_id=bad)


def test_unknown_scheme_is_refused():
    with pytest.raises(ConfigError, match="store_uri.*gs"):
        open_store("gs://bucket/x")


def test_s3_roundtrip_over_http(tmp_path, s3_server):
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    s3.create_bucket(Bucket="ckpt")
    ck = _fake_checkpoint(tmp_path / "local", 42)
    c = upload_checkpoint(ck, "s3://ckpt/team-a", experiment="e", run_id="r")
    assert c.uri == "s3://ckpt/team-a/e/r/step_00000042"
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpt")["Contents"])
    assert keys == ["team-a/e/r/latest", *[f"team-a/e/r/step_00000042/{n}" for n in
                    ("__0_0.distcp", MANIFEST, "model.safetensors")]]
    again = upload_checkpoint(ck, "s3://ckpt/team-a", experiment="e", run_id="r")
    assert again.uploaded == 0
    local, manifest, warnings = fetch_checkpoint("s3://ckpt/team-a", experiment="e", run_id="r", dest=tmp_path / "dl")
    assert warnings == [] and (local / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()


def test_s3_missing_bucket_is_a_clear_error(tmp_path, s3_server):
    ck = _fake_checkpoint(tmp_path / "local", 1)
    with pytest.raises(StoreError, match="bucket 'nope' does not exist"):
        upload_checkpoint(ck, "s3://nope/x", experiment="e", run_id="r")
