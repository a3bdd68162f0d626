"""The training image, built for real (scripts/images.py, `make images`' recipe on a base made
from Debian packages) and run the way the pods' security context demands: uid 10001, a read-only
root filesystem, every capability dropped, no privilege escalation, a writable /tmp only."""

from __future__ import annotations

import json

import pytest

from tests.e2e.pods import run_to_end

pytestmark = pytest.mark.slow  # builds the image (minutes without a cache)

# What a training pod's securityContext makes of a container (plugins/.../kubernetes/spec.py).
RESTRICTED = ["--user", "10001:10001", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
              "--tmpfs", "/tmp:rw,size=1g", "--env", "HOME=/tmp", "--env", "TMPDIR=/tmp"]
SIZE_GOAL_BYTES = 1.8e9  # the CPU variant (docs/benchmarks.md "Training image")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("image-data")
    folder.chmod(0o777)  # written by uid 10001
    return folder


def _run(engine, image, *args, volume=None, timeout_s=300):
    mount = ["--volume", f"{volume}:/data"] if volume else []
    return run_to_end(engine, [*RESTRICTED, *mount, image, *args], timeout_s=timeout_s)


def test_cli_help_runs_as_the_pod_user(container_engine, training_image):
    code, out = _run(container_engine, training_image, "--help")
    assert code == 0, out
    assert "make-data" in out and "train" in out
    code, out = run_to_end(container_engine, [*RESTRICTED, "--entrypoint", "sh", training_image, "-c",
                                              "id -u; touch /app/x 2>&1; grep CapEff /proc/self/status"])
    uid, refused, caps = out.strip().splitlines()
    assert (uid, caps.split()[-1]) == ("10001", "0000000000000000") and "Read-only file system" in refused


def test_make_data_and_a_two_rank_torchrun_train(container_engine, training_image, data_dir):
    code, out = _run(container_engine, training_image, "make-data", "--out", "/data/teacher", "--train-rows", "4000",
                     "--val-rows", "1000", volume=data_dir)
    assert code == 0, out
    assert (data_dir / "teacher" / "dataset.json").is_file()
    sets = {"dataset_uri": "/data/teacher", "checkpoint_dir": "/data/ck", "output_dir": "/data/out", "steps": 20,
            "batch_size": 32, "log_every": 10, "checkpoint_every": 10}
    code, out = run_to_end(container_engine, [
        *RESTRICTED, "--volume", f"{data_dir}:/data", "--env", "GLOO_SOCKET_IFNAME=lo", "--env", "OMP_NUM_THREADS=1",
        "--entrypoint", "torchrun", training_image, "--standalone", "--nproc-per-node", "2", "-m", "training", "train",
        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
    assert code == 0, out[-4000:]
    assert "train: mlp/ddp/fp32 on 2 ranks (ddp x2), backend=gloo" in out and "train: done at step 20" in out
    final = data_dir / "ck" / "step_00000020"
    assert {"manifest.json", "model.safetensors", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in final.iterdir()}


def test_a_language_model_tokenizes_and_trains_in_the_image(container_engine, training_image, data_dir):
    """What a pod does with text: the help text, a BPE trained in the container, the token windows
    in a store, two ranks reading them (with activation checkpointing), the model exported with its
    tokenizer."""
    code, out = _run(container_engine, training_image, "make-data", "--kind", "text", "--out", "/data/text",
                     volume=data_dir)
    assert code == 0, out
    code, out = _run(container_engine, training_image, "tokenize", "--dataset-uri", "/data/text", "--text-column",
                     "text", "--tokenizer", "bpe:300", "--seq-len", "32", "--out", "/data/store", volume=data_dir)
    assert code == 0, out
    shards = json.loads(out.strip().splitlines()[-1])["token_shards"]
    sets = {"dataset_uri": "/data/text", "text_column": "text", "token_shards": shards, "model": "transformer",
            "hidden": 32, "depth": 2, "seq_len": 32, "steps": 10, "batch_size": 16, "log_every": 5,
            "checkpoint_every": 0, "activation_checkpointing": "full", "checkpoint_dir": "/data/ck-text",
            "output_dir": "/data/out-text"}
    code, out = run_to_end(container_engine, [
        *RESTRICTED, "--volume", f"{data_dir}:/data", "--env", "GLOO_SOCKET_IFNAME=lo", "--env", "OMP_NUM_THREADS=1",
        "--entrypoint", "torchrun", training_image, "--standalone", "--nproc-per-node", "2", "-m", "training", "train",
        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
    assert code == 0, out[-4000:]
    assert "train: done at step 10" in out, out[-4000:]
    assert {"model.safetensors", "tokenizer.json"} <= {p.name for p in (data_dir / "ck-text" / "step_00000010").iterdir()}


def test_no_pip_configuration_or_host_file_is_in_the_image(container_engine, training_image):
    """The build's secrets and volumes (pip.conf, the CA bundle, local wheel folders) left nothing."""
    script = ("find / -xdev -path /usr/share/python-wheels -prune -o \\( -name pip.conf -o -name '*.whl' \\) "
              "-print 2>/dev/null; find /run/host -type f 2>/dev/null; env | grep ^PIP_CONFIG_FILE; true")
    code, out = run_to_end(container_engine, ["--user", "0", "--entrypoint", "sh", training_image, "-c", script])
    assert code == 0 and out.strip() == "", out


def test_the_cpu_image_stays_under_its_size_goal(container_engine, training_image):
    size = container_engine.image_bytes(training_image)
    assert size <= SIZE_GOAL_BYTES, f"{size / 1e9:.2f} GB"
