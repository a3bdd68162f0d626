"""The checkpoint store under faults, against moto's S3 server as a real process on 127.0.0.1 (real
HTTP, the real boto3 client and transfer manager): a server that dies or stalls in the middle of a
multipart upload, objects altered, truncated or deleted behind our back, retries, retention, and
the errors a person sees for a missing bucket, bad credentials and an unreachable endpoint.

The retry budget is kept small through the store's own settings (AWS_MAX_ATTEMPTS=2, a short
read timeout), so the failure tests take seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import boto3
import pytest
import requests

from tests.conftest import free_port, local_checkpoint, wait_for_port
from training.config.fields import ConfigError
from training.checkpoint.commit import LATEST, MANIFEST, fetch_checkpoint, upload_checkpoint
from training.checkpoint.retention import apply_retention, record_eval
from training.store import open_store
from training.store.base import StoreError

STORE = "s3://ckpt/team"
PREFIX = "team/e/r"


class Moto:
    """moto_server on 127.0.0.1 with its request log (werkzeug writes one line per request)."""

    def __init__(self, tmp: Path, port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"moto-{self.port}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        wait_for_port(self.port)

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint)

    def requests(self) -> list[str]:
        """'METHOD /path?query' of every request the server answered."""
        self._log.flush()
        return re.findall(r'"([A-Z]+ \S+) HTTP/1\.[01]"', self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("TRAINING_S3_CONNECT_TIMEOUT_S", "2")
    monkeypatch.setenv("TRAINING_S3_READ_TIMEOUT_S", "2")


@pytest.fixture
def moto_process(tmp_path, monkeypatch, fast_retries):
    """A server of the test's own, to kill or stop mid-upload."""
    server = Moto(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    server.client().create_bucket(Bucket="ckpt")
    yield server
    server.stop()


@pytest.fixture
def moto(s3_server, fast_retries):
    """The session's S3 server (emptied for the test), with the bucket ``ckpt``."""
    server = SimpleNamespace(endpoint=s3_server["endpoint"],
                             client=lambda: boto3.client("s3", endpoint_url=s3_server["endpoint"]))
    server.client().create_bucket(Bucket="ckpt")
    return server


def _checkpoint(root: Path, step: int, *, big_mb: int = 0, payload: bytes = b"w") -> Path:
    files = {"__0_0.distcp": payload * 5000 + str(step).encode(), "model.safetensors": payload * 700 + str(step).encode()}
    if big_mb:
        files["__1_0.distcp"] = os.urandom(big_mb << 20)
    return local_checkpoint(root, step, files)


def _kill_after_first_part(server: Moto, how: signal.Signals, done: threading.Event) -> None:
    """Signal the server right after it stored the first part of a multipart upload: a handler on
    botocore's own event of a completed UploadPart call, in the uploading client (the store's
    clients come from boto3's default session). Deterministic: the upload never outruns it, however
    busy the machine is (a watcher polling the server from the side could be starved)."""
    import boto3

    def after_part(**_kwargs) -> None:
        if not done.is_set():
            done.set()
            os.kill(server.proc.pid, how)

    boto3.setup_default_session()
    boto3.DEFAULT_SESSION.events.register("after-call.s3.UploadPart", after_part)


@pytest.fixture
def slow_parts(monkeypatch):
    # 5 MiB parts (the S3 minimum), one at a time: a 40 MiB shard is 8 sequential part uploads,
    # so the server is stopped with most of the shard still to go.
    monkeypatch.setenv("TRAINING_S3_PART_SIZE_MB", "5")
    monkeypatch.setenv("TRAINING_S3_CONCURRENCY", "1")


@pytest.mark.slow  # a server process of its own, killed
def test_server_killed_mid_multipart_upload(moto_process, tmp_path, slow_parts, monkeypatch):
    moto = moto_process
    upload_checkpoint(_checkpoint(tmp_path / "l", 100), STORE, experiment="e", run_id="r")
    big = _checkpoint(tmp_path / "l", 200, big_mb=40)

    done = threading.Event()
    _kill_after_first_part(moto, signal.SIGKILL, done)
    with pytest.raises(StoreError) as err:
        upload_checkpoint(big, STORE, experiment="e", run_id="r")
    done.set()
    assert moto.proc.wait(timeout=10) == -signal.SIGKILL, "the server was killed mid-upload"
    msg = str(err.value)
    assert re.search(r"(connection to s3://ckpt at .* lost|S3 endpoint unreachable) after 2 attempts", msg), msg

    # What the server answered before it died: the shard's multipart upload started, parts went
    # in, but it was never completed, no manifest for step 200 was written and `latest` was
    # written once only (by the step-100 commit).
    seen = moto.requests()
    assert any(r.startswith("POST /ckpt/team/e/r/step_00000200/__1_0.distcp?uploads") for r in seen), seen
    assert any("partNumber=1" in r for r in seen)
    assert not any(r.startswith("POST /ckpt/team/e/r/step_00000200/__1_0.distcp?uploadId") for r in seen), "completed?"
    assert not any(r.startswith("PUT /ckpt/team/e/r/step_00000200/manifest.json") for r in seen)
    assert [r for r in seen if r.startswith(f"PUT /ckpt/{PREFIX}/{LATEST}")] == [f"PUT /ckpt/{PREFIX}/{LATEST}"]

    # The task is retried against a server restarted on the same address (moto keeps nothing,
    # like a store that lost everything): the retry commits the whole checkpoint.
    moto.stop()
    again = Moto(tmp_path, port=moto.port)
    try:
        again.client().create_bucket(Bucket="ckpt")
        c = upload_checkpoint(big, STORE, experiment="e", run_id="r")
        assert c.uploaded == 3
        latest = json.loads(again.client().get_object(Bucket="ckpt", Key=f"{PREFIX}/{LATEST}")["Body"].read())
        assert latest["step_dir"] == "step_00000200"
        local, manifest, warnings = fetch_checkpoint(STORE, experiment="e", run_id="r", dest=tmp_path / "dl")
        assert manifest["step"] == 200 and warnings == []
        assert (local / "__1_0.distcp").read_bytes() == (big / "__1_0.distcp").read_bytes()
    finally:
        again.stop()


@pytest.mark.slow  # a server process of its own, stopped
def test_server_stalled_mid_multipart_upload_keeps_latest_on_the_good_checkpoint(moto_process, tmp_path, slow_parts):
    """SIGSTOP instead of a kill: the server keeps its data, so we can look at what survived."""
    moto = moto_process
    upload_checkpoint(_checkpoint(tmp_path / "l", 100), STORE, experiment="e", run_id="r")
    big = _checkpoint(tmp_path / "l", 200, big_mb=40)

    done = threading.Event()
    _kill_after_first_part(moto, signal.SIGSTOP, done)
    with pytest.raises(StoreError, match=r"(lost|unreachable) after 2 attempts"):
        upload_checkpoint(big, STORE, experiment="e", run_id="r")
    done.set()
    os.kill(moto.proc.pid, signal.SIGCONT)

    s3 = moto.client()
    latest = json.loads(s3.get_object(Bucket="ckpt", Key=f"{PREFIX}/{LATEST}")["Body"].read())
    assert latest["step_dir"] == "step_00000100", "latest never names the partial checkpoint"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix=f"{PREFIX}/step_00000200/").get("Contents", [])}
    assert f"{PREFIX}/step_00000200/{MANIFEST}" not in keys and f"{PREFIX}/step_00000200/__1_0.distcp" not in keys
    local, manifest, warnings = fetch_checkpoint(STORE, experiment="e", run_id="r", dest=tmp_path / "dl")
    assert manifest["step"] == 100 and local.name == "step_00000100"

    # The retry skips what is already there and commits step 200.
    c = upload_checkpoint(big, STORE, experiment="e", run_id="r")
    assert c.skipped == len(keys) and c.uploaded == 3 - len(keys)
    assert json.loads(s3.get_object(Bucket="ckpt", Key=f"{PREFIX}/{LATEST}")["Body"].read())["step_dir"] == "step_00000200"


def _two_checkpoints(tmp_path):
    for step in (100, 200):
        upload_checkpoint(_checkpoint(tmp_path / "l", step, payload=str(step).encode()), STORE, experiment="e", run_id="r")


@pytest.mark.parametrize("damage, says", [
    ("flip", "step_00000200/__0_0.distcp does not match its manifest sha256"),
    ("truncate", "step_00000200/__0_0.distcp has 7501 bytes, its manifest says 15003"),
    ("delete", "step_00000200/__0_0.distcp is missing from s3://ckpt/team"),
])
def test_damaged_object_falls_back_to_previous(moto, tmp_path, damage, says, caplog):
    _two_checkpoints(tmp_path)
    s3, key = moto.client(), f"{PREFIX}/step_00000200/__0_0.distcp"
    body = bytearray(s3.get_object(Bucket="ckpt", Key=key)["Body"].read())
    if damage == "flip":
        body[100] ^= 0x01
        s3.put_object(Bucket="ckpt", Key=key, Body=bytes(body))
    elif damage == "truncate":
        s3.put_object(Bucket="ckpt", Key=key, Body=bytes(body[: len(body) // 2]))
    else:
        s3.delete_object(Bucket="ckpt", Key=key)

    local, manifest, warnings = fetch_checkpoint(STORE, experiment="e", run_id="r", dest=tmp_path / "dl")
    assert manifest["step"] == 100 and local.name == "step_00000100"
    assert len(warnings) == 1 and says in warnings[0] and "falling back" in warnings[0], warnings
    assert any("checkpoint fallback" in r.message and says in r.message for r in caplog.records)
    assert not (tmp_path / "dl" / "step_00000200").exists()


def test_deleted_manifest_means_ignored(moto, tmp_path):
    _two_checkpoints(tmp_path)
    moto.client().delete_object(Bucket="ckpt", Key=f"{PREFIX}/step_00000200/{MANIFEST}")
    local, manifest, warnings = fetch_checkpoint(STORE, experiment="e", run_id="r", dest=tmp_path / "dl")
    assert manifest["step"] == 100
    assert warnings == ["step_00000200: no manifest (incomplete upload), ignored"]


def test_replaced_manifest_is_not_trusted(moto, tmp_path):
    """A manifest rewritten after commit (to match altered objects) differs from what `latest` recorded."""
    _two_checkpoints(tmp_path)
    s3 = moto.client()
    m = json.loads(s3.get_object(Bucket="ckpt", Key=f"{PREFIX}/step_00000200/{MANIFEST}")["Body"].read())
    m["step"] = 201
    s3.put_object(Bucket="ckpt", Key=f"{PREFIX}/step_00000200/{MANIFEST}", Body=json.dumps(m).encode())
    _, manifest, warnings = fetch_checkpoint(STORE, experiment="e", run_id="r", dest=tmp_path / "dl")
    assert manifest["step"] == 100 and "differs from the one `latest` committed" in warnings[0]


def test_reupload_twice_same_objects_no_duplicates(moto, tmp_path):
    ck = _checkpoint(tmp_path / "l", 300, big_mb=6)  # one multipart object among them
    s3 = moto.client()

    def objects():
        return {o["Key"]: (o["ETag"], o["Size"], o["LastModified"]) for o in s3.list_objects_v2(Bucket="ckpt")["Contents"]}

    first = upload_checkpoint(ck, STORE, experiment="e", run_id="r")
    before = objects()
    time.sleep(1.1)  # LastModified has one-second resolution: a rewrite would show
    for _ in range(2):
        again = upload_checkpoint(ck, STORE, experiment="e", run_id="r")
        assert (again.uploaded, again.skipped) == (0, first.uploaded)
    after = objects()
    assert sorted(after) == sorted(before) == sorted(
        [f"{PREFIX}/{LATEST}"] + [f"{PREFIX}/step_00000300/{n}" for n in
                                   ("__0_0.distcp", "__1_0.distcp", MANIFEST, "model.safetensors")])
    assert {k: v for k, v in after.items() if not k.endswith(LATEST)} == {k: v for k, v in before.items() if not k.endswith(LATEST)}
    assert s3.list_multipart_uploads(Bucket="ckpt").get("Uploads", []) == []


def test_changed_bytes_never_overwrite_a_committed_checkpoint(moto, tmp_path):
    upload_checkpoint(_checkpoint(tmp_path / "l", 5), STORE, experiment="e", run_id="r")
    with pytest.raises(StoreError, match="already committed with different content"):
        upload_checkpoint(_checkpoint(tmp_path / "l2", 5, payload=b"different"), STORE, experiment="e", run_id="r")
    body = moto.client().get_object(Bucket="ckpt", Key=f"{PREFIX}/step_00000005/model.safetensors")["Body"].read()
    assert body != b"different"


def test_late_upload_of_an_older_checkpoint_keeps_latest(moto, tmp_path):
    upload_checkpoint(_checkpoint(tmp_path / "l", 200), STORE, experiment="e", run_id="r")
    upload_checkpoint(_checkpoint(tmp_path / "l", 100), STORE, experiment="e", run_id="r")
    latest = json.loads(moto.client().get_object(Bucket="ckpt", Key=f"{PREFIX}/{LATEST}")["Body"].read())
    assert latest["step_dir"] == "step_00000200"


# --------------------------------------------------------------------------- errors


def test_missing_bucket(moto, tmp_path):
    with pytest.raises(StoreError, match=r"bucket 'nope' does not exist .*create it or fix store_uri"):
        upload_checkpoint(_checkpoint(tmp_path / "l", 1), "s3://nope/x", experiment="e", run_id="r")


def test_access_denied(s3_server, tmp_path, monkeypatch, fast_retries):
    # moto enforces IAM once the no-auth request count set through /moto-api/reset-auth is used up:
    # with 0, our made-up key is refused like a revoked one on a real endpoint.
    endpoint = s3_server["endpoint"]
    requests.post(f"{endpoint}/moto-api/reset-auth", data="0", timeout=10).raise_for_status()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        with pytest.raises(StoreError) as err:
            upload_checkpoint(_checkpoint(tmp_path / "l", 1), STORE, experiment="e", run_id="r")
    finally:
        requests.post(f"{endpoint}/moto-api/reset-auth", data="inf", timeout=10).raise_for_status()
    msg = str(err.value)
    assert msg.startswith(f"access denied to s3://ckpt at {endpoint}") and "InvalidAccessKeyId" in msg
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in msg


def test_unreachable_endpoint_after_retries(tmp_path, monkeypatch, fast_retries):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=rf"S3 endpoint unreachable after 2 attempts .*{re.escape(dead)}"):
        upload_checkpoint(_checkpoint(tmp_path / "l", 1), STORE, experiment="e", run_id="r")
    assert time.monotonic() - t0 < 60  # the small budget applied (8 attempts would back off far longer)


def test_unknown_scheme_is_refused():
    with pytest.raises(ConfigError, match="store_uri.*'gs'.*file:///absolute/folder or s3://bucket/prefix"):
        open_store("gs://bucket/x")


def test_settings_handed_to_the_store_override_the_environment(moto, tmp_path, monkeypatch):
    """How the Airflow side passes a connection's endpoint and keys: a mapping for this store only."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # dead
    env = {"AWS_ENDPOINT_URL": moto.endpoint, "AWS_ACCESS_KEY_ID": "conn-key", "AWS_SECRET_ACCESS_KEY": "conn-secret"}
    c = upload_checkpoint(_checkpoint(tmp_path / "l", 7), STORE, experiment="e", run_id="r", env=env)
    assert c.uploaded == 2
    _, manifest, _ = fetch_checkpoint(STORE, experiment="e", run_id="r", dest=tmp_path / "dl", env=env)
    assert manifest["step"] == 7


# --------------------------------------------------------------------------- retention


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_retention_keeps_last_best_and_latest(tmp_path, backend, request):
    if backend == "s3":
        request.getfixturevalue("moto")
        store = STORE
    else:
        store = (tmp_path / "store").as_uri()
    for step in (1, 2, 3, 4, 5):
        upload_checkpoint(_checkpoint(tmp_path / "l", step), store, experiment="e", run_id="r")
        record_eval(store, experiment="e", run_id="r", step_dir=f"step_{step:08d}", metrics={"eval/loss": 1.0 / step})
    record_eval(store, experiment="e", run_id="r", step_dir="step_00000002", metrics={"eval/loss": 0.01})  # the best
    s = open_store(store)
    # `latest` on step 3 (as after a late retry); an abandoned upload left step 4b without manifest.
    s.put_bytes(json.dumps({"step_dir": "step_00000003", "step": 3}).encode(), f"e/r/{LATEST}")
    s.put_bytes(b"partial", "e/r/step_00000004b/__0_0.distcp")

    r = apply_retention(store, experiment="e", run_id="r", keep_last=1)
    assert r.deleted == ["step_00000001", "step_00000004", "step_00000004b"]
    assert r.kept == ["step_00000002", "step_00000003", "step_00000005"]
    assert r.reasons == {"step_00000002": "best eval/loss", "step_00000003": "latest", "step_00000005": "among the last 1"}
    assert sorted(d for d in s.list_dirs("e/r")) == r.kept
    assert s.list_keys("e/r/step_00000001") == []
    _, manifest, warnings = fetch_checkpoint(store, experiment="e", run_id="r", dest=tmp_path / "dl")
    assert manifest["step"] == 3 and warnings == []

    assert apply_retention(store, experiment="e", run_id="r", keep_last=0).deleted == []
    with pytest.raises(ConfigError, match="retention_keep_last"):
        apply_retention(store, experiment="e", run_id="r", keep_last=-1)


# --------------------------------------------------------------------------- streams (what the ranks write)


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_stream_lands_whole_or_not_at_all(tmp_path, backend, request, monkeypatch):
    """``open_write`` is how each rank writes its shard: S3 uploads it in parts while it is being
    written (5 MiB parts here, so 12 MiB is a multipart upload); a writer that fails half-way
    leaves no object and no open multipart upload behind."""
    if backend == "s3":
        moto = request.getfixturevalue("moto")
        monkeypatch.setenv("TRAINING_S3_PART_SIZE_MB", "5")
        store = open_store(STORE)
    else:
        store = open_store((tmp_path / "store").as_uri())
    data = os.urandom(12 << 20)
    with store.open_write("e/r/step_00000001/__0_0.distcp") as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i : i + (1 << 20)])
    assert store.get_bytes("e/r/step_00000001/__0_0.distcp") == data
    with pytest.raises(RuntimeError, match="serializing failed"):
        with store.open_write("e/r/step_00000001/__1_0.distcp") as f:
            f.write(data[: 11 << 20])
            raise RuntimeError("serializing failed")
    assert store.list_keys("e/r/step_00000001") == ["e/r/step_00000001/__0_0.distcp"]
    if backend == "s3":
        assert moto.client().list_multipart_uploads(Bucket="ckpt").get("Uploads", []) == []
