"""A model too large to register as ``pt2`` is registered from its exported folder (pyfunc from
code, ``registry.flavour = pyfunc-folder``), on the test MLflow store: it predicts what the model
predicts, and its registration runs under a memory limit smaller than the model (a cgroup memory
limit, as a container runtime sets a pod's; see tests/memlimit.py) where ``pt2`` is killed."""

import hashlib
import json
import sys

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import save_file

from tests import memlimit
from training.checkpoint.export import MODEL_CONFIG_FILE, MODEL_FILE, order, write_streamed
from training.config.fields import ConfigError
from training.data.synthetic import read_meta
from training.evaluate import example_inputs
from training.models.build import build_model
from training.models.spec import ModelSpec
from training.results import logged_model, registry
from training.tracking.run import open_run


class _Stats:  # what ModelSpec.for_data reads of a streamed split: the normalization statistics
    stats = {"features": (np.full(16, 0.5), np.full(16, 2.0)), "labels": (np.ones(1), np.full(1, 3.0))}


def _export(folder, spec: ModelSpec, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(spec).eval()
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / MODEL_FILE))
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps(spec.to_json()))
    return model


def _register(name: str, folder, rows, **kwargs):
    run_id = open_run(name, dag_id="distributed_training", dag_run_id=f"manual__{name}")
    result = registry.register_and_gate(run_id=run_id, model_dir=folder, registered_model=name, metric_value=0.5,
                                        margin=0.0, example_inputs=rows, step=10, **kwargs)
    return run_id, result


@pytest.mark.slow  # starts a Python process (tests/processes.py)
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_model_over_the_bound_is_registered_from_its_folder(dataset, tmp_path, task):
    meta = {**read_meta(dataset), "task": task, "normalize": True}
    spec = ModelSpec.for_data("mlp", meta, hidden=32, depth=2, train=_Stats())
    model = _export(tmp_path / "model", spec)
    rows = example_inputs(str(dataset))
    # The bound set low (the worker's memory decides it otherwise): this small model is over it.
    run_id, result = _register(f"folder-{task}", tmp_path / "model", rows, pt2_bound=1024)

    client = MlflowClient()
    version = client.get_model_version(result["registered_model"], result["version"])
    size = (tmp_path / "model" / MODEL_FILE).stat().st_size
    for tags in (version.tags, client.get_run(run_id).data.tags):
        assert tags["registry.flavour"] == "pyfunc-folder"
        assert tags["registry.pt2_bound_bytes"] == "1024" and 1024 < int(tags["registry.parameter_bytes"]) < size
        assert "> the pt2 bound 0.0 MiB (given)" in tags["registry.flavour_reason"]

    loaded = mlflow.pyfunc.load_model(result["model_uri"])
    assert "pytorch" not in loaded.metadata.flavors, "logged from the folder, not by torch.export"
    (inputs,), (outputs,) = loaded.metadata.get_input_schema().inputs, loaded.metadata.get_output_schema().inputs
    assert inputs.shape == (-1, 16) and inputs.type == np.dtype("float32")
    assert outputs.shape == ((-1, spec.n_classes) if task == "classification" else (-1,))
    assert outputs.type == np.dtype("float32")
    val = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(val)).numpy()
    np.testing.assert_array_equal(loaded.predict(val), want)
    # Where the gate re-scores a champion, it finds the exported folder in the downloaded model.
    local = mlflow.artifacts.download_artifacts(result["model_uri"], dst_path=str(tmp_path / "download"))
    again = registry.exported_folder(local)
    assert (again / MODEL_FILE).read_bytes() == (tmp_path / "model" / MODEL_FILE).read_bytes()


def test_the_flavour_choice(dataset, tmp_path):
    spec = ModelSpec.for_data("mlp", read_meta(dataset), hidden=32, depth=2)
    _export(tmp_path / "model", spec)
    auto = logged_model.choose_flavour(tmp_path / "model")  # this small model fits this machine's memory
    assert (auto.name, auto.load) == ("pt2", True) and "this process may still use" in auto.reason
    forced = logged_model.choose_flavour(tmp_path / "model", "pyfunc-folder")
    assert (forced.name, forced.load, forced.reason.endswith("registry_flavour=pyfunc-folder")) == (
        "pyfunc-folder", False, True)
    with pytest.raises(ConfigError, match="'registry_flavour': unknown flavour 'onnx'"):
        logged_model.choose_flavour(tmp_path / "model", "onnx")


# ------------------------------------------------------------------ under a memory limit

HIDDEN, DEPTH = 4096, 9  # eight 4096x4096 float32 layers: 512 MiB of parameters
BUDGET = 128 << 20  # what the limit leaves above the registering process's own memory once it is up

CHILD = r"""
import resource, sys
import numpy as np
folder, run_id, name, flavour = sys.argv[1:]
# What a worker that registers models has loaded anyway: its libraries and the tracking store.
import mlflow.pyfunc, mlflow.pytorch, pandas, torch
from mlflow.tracking import MlflowClient
from training.models.build import build_model
from training.results import folder_model, registry
MlflowClient().get_run(run_id)
print("ready", flush=True)
ready = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sys.stdin.readline()  # the limit is set now
result = registry.register_and_gate(run_id=run_id, model_dir=folder, registered_model=name, metric_value=0.5,
                                    margin=0.0, example_inputs=np.zeros((5, 16), dtype=np.float32), step=10,
                                    flavour=flavour)
print("done", result["version"], "grew by", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - ready,
      flush=True)
"""


def write_model(folder, depth: int = DEPTH) -> int:
    """An exported table model (``depth`` layers of ``HIDDEN``) written tensor by tensor, never whole
    in memory; its parameter bytes. benchmarks/registry_memory_bench.py writes its models with it."""
    meta = {"kind": "tabular", "task": "classification", "features": [f"f{i}" for i in range(16)], "label": "label",
            "n_classes": 4}
    spec = ModelSpec.for_data("mlp", meta, hidden=HIDDEN, depth=depth)
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in build_model(spec, meta=True).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    write_streamed(folder / MODEL_FILE, layout, ((n, torch.randn(layout[n][1], generator=g) * 0.02)
                                                 for n in order(layout)))
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps(spec.to_json()))
    return sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in layout.values())


def _register_under_limit(folder, name: str, flavour: str) -> tuple[int, str, int, int]:
    """Register in a fresh memory group whose limit, once the interpreter is up, is what it uses
    then + BUDGET. Returns exit code, output, limit, peak."""
    run_id = open_run(name, dag_id="distributed_training", dag_run_id=f"manual__{name}")
    return memlimit.run_once_ready("dtp-register", [sys.executable, "-c", CHILD, str(folder), run_id, name, flavour],
                                   BUDGET)


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.mark.slow
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_registration_of_a_model_larger_than_the_limit(tmp_path):
    size = write_model(tmp_path / "model")

    rc, output, limit, peak = _register_under_limit(tmp_path / "model", "bounded-register", "auto")
    assert rc == 0 and "done" in output, output[-3000:]
    assert size > limit, "the model must be larger than the limit"
    grew = int(output.split("grew by")[1])
    assert peak <= limit and grew < BUDGET
    print(f"parameters {size / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB (the group's peak, page cache "
          f"included: {peak / 2**20:.0f} MiB), registering grew the resident set by {grew / 2**20:.0f} MiB")
    client = MlflowClient()
    version = client.get_model_version("bounded-register", "1")
    assert version.tags["registry.flavour"] == "pyfunc-folder"  # auto, from the cgroup limit the process is under
    assert "the memory limit of cgroup v1" in version.tags["registry.flavour_reason"]
    local = mlflow.artifacts.download_artifacts(f"models:/bounded-register/1", dst_path=str(tmp_path / "download"))
    assert _sha256(registry.exported_folder(local) / MODEL_FILE) == _sha256(tmp_path / "model" / MODEL_FILE)

    rc, output, _, _ = _register_under_limit(tmp_path / "model", "whole-register", "pt2")
    assert rc == -9, f"registering the whole model was not stopped by the limit (exit {rc}): {output[-2000:]}"


SCORE = r"""
import resource, sys
folder, data, mode = sys.argv[1:]
import torch
from training.data.dataset import open_dataset
from training.evaluate import score_folder
ds = open_dataset(data)
print("ready", flush=True)
sys.stdin.readline()  # the limit is set now
if mode == "copied":  # how an exported model was loaded before: built with its weights, the file's copied in
    import training.models.build as build, training.models.materialize as materialize
    whole = build.build_model
    build.build_model = lambda spec, meta=False: whole(spec)
    materialize.assign_weights = lambda model, tensors, source: model.load_state_dict(tensors)
print("scored", score_folder(folder, ds)["eval/accuracy"], flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_a_champion_larger_than_the_limit_is_rescored_from_the_mapped_file(tmp_path):
    """The gate re-scores a champion trained on other data on this run's validation rows
    (``score_model``); the champion's weights are read as the file's pages, which the kernel drops
    and reads again under the limit, so a model larger than the worker's limit is still scored."""
    import os

    from training.data.synthetic import make_teacher_dataset

    size = write_model(tmp_path / "model")
    make_teacher_dataset(tmp_path / "data", n_train=64, n_val=256, n_classes=4)
    fd = os.open(tmp_path / "model" / MODEL_FILE, os.O_RDONLY)  # as on a worker that has just downloaded it:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # its pages read (and charged) by the scoring process
    os.close(fd)
    argv = [sys.executable, "-c", SCORE, str(tmp_path / "model"), str(tmp_path / "data")]
    rc, output, limit, peak = memlimit.run_once_ready("dtp-score", [*argv, "mapped"], BUDGET, timeout=300)
    assert rc == 0 and "scored" in output, output[-3000:]
    assert size > limit and peak <= limit
    accuracy = float(output.split("scored")[1])
    assert 0.0 <= accuracy <= 1.0
    print(f"parameters {size / 2**20:.0f} MiB scored under a limit of {limit / 2**20:.0f} MiB (the group's peak, "
          f"page cache included: {peak / 2**20:.0f} MiB)")
    rc, output, _, _ = memlimit.run_once_ready("dtp-score", [*argv, "copied"], BUDGET, timeout=300)
    assert rc == -9, f"loading the weights as a copy was not stopped by the limit (exit {rc}): {output[-2000:]}"


def test_a_text_model_over_the_bound_is_not_loaded_to_register_it(tmp_path):
    import pandas as pd

    from training.data.tokenizer import resolve
    from training.results.text_model import load_text_folder, predict_text

    tokenizer = resolve("bytes", train_documents=lambda: [])
    spec = ModelSpec(model="transformer", kind="tokens", task="classification", features=["text"], label=None,
                     n_classes=tokenizer.vocab_size, vocab_size=tokenizer.vocab_size, seq_len=16,
                     tokenizer_sha256=tokenizer.sha256,
                     arch={"d_model": 32, "n_layers": 1, "n_heads": 2, "dropout": 0.0})
    _export(tmp_path / "lm", spec)
    tokenizer.tokenizer.save(str(tmp_path / "lm" / "tokenizer.json"))
    run_id, result = _register("folder-lm", tmp_path / "lm", None, pt2_bound=1024)

    tags = MlflowClient().get_run(run_id).data.tags
    assert tags["registry.flavour"] == "pyfunc-text" and "not loaded" in tags["registry.flavour_reason"]
    loaded = mlflow.pyfunc.load_model(result["model_uri"])
    assert loaded.metadata.get_output_schema().inputs[0].type.name == "string"
    texts = ["Once upon", "The "]
    got = loaded.predict(pd.DataFrame({"text": texts}), params={"new_tokens": 6})
    model, spec, tok = load_text_folder(tmp_path / "lm")
    assert list(got) == predict_text(model, spec, tok, texts, new_tokens=6)
