"""Evaluation streams token shards' validation split block by block (training/evaluate.py,
``score_blocks``): the same figures as scoring the split in memory, each rank reading only the
blocks of its own share (two gloo ranks under torchrun, the real ``Evaluator``), and a rank's
resident memory not growing with the split's size (measured in a fresh process).

Run as a program (``python -m tests.training.test_evaluate_stream ranks|memory ...``) it is the
process those tests measure."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config.fields import ConfigError
from training.config.train_config import TrainConfig
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.stream import NpyBlocks
from training.data.synthetic import grow_token_shards, make_text_dataset
from training.data.tokenizer import resolve
from training.data.tokens import MANIFEST, TokenDataset, build, open_shards
from training.distributed.launch import torchrun_command
from training.evaluate import Evaluator, _batches, score, score_blocks, score_spec, validation_for
from training.models.build import build_model
from training.models.spec import ModelSpec
from training.results import reports

ROOT = Path(__file__).resolve().parents[2]
SEQ = 32
BLOCK_ROWS = 50  # small blocks, so that batches and ranks' shares cut through them
GROWTH_BOUND = 64 << 20


def _shards(root: Path, labels: bool) -> str:
    make_text_dataset(root / "data", labels=labels)
    ds = open_dataset(root / "data", DataOptions(text_column="text", label_column="label" if labels else ""))
    tok = resolve("bytes", train_documents=lambda: [])
    return build(ds, text_column="text", tokenizer=tok, seq_len=SEQ, store_uri=str(root / "store")).uri


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> str:
    return _shards(tmp_path_factory.mktemp("eval-lm"), labels=False)


@pytest.fixture(scope="module")
def classes(tmp_path_factory) -> str:
    return _shards(tmp_path_factory.mktemp("eval-classes"), labels=True)


def _model(ds: TokenDataset) -> tuple[torch.nn.Module, ModelSpec]:
    spec = ModelSpec.for_data("transformer", ds.meta, hidden=16, depth=1, n_heads=2)
    torch.manual_seed(0)
    return build_model(spec), spec


def _small_blocks(ds: TokenDataset) -> NpyBlocks:
    rows = NpyBlocks(ds.folder, "validation").rows
    return NpyBlocks(ds.folder, "validation", block_bytes=BLOCK_ROWS * rows.row_bytes)


class SmallBlocks(TokenDataset):
    """The same shards, streamed in blocks of ``BLOCK_ROWS`` rows; the block ids of every read kept."""

    def __init__(self, ds: TokenDataset):
        super().__init__(ds.uri, ds.folder, json.loads((ds.folder / MANIFEST).read_text()))
        self.reads: list[list[int]] = []

    def blocks(self, name: str, spec=None) -> NpyBlocks:
        super().blocks(name, spec)  # the seq_len check
        source = _small_blocks(self)
        read = source.read_window
        source.read_window = lambda ids: (self.reads.append(ids.tolist()), read(ids))[1]
        return source


@pytest.mark.parametrize("data", ["lm", "classes"])
def test_streamed_scoring_gives_the_in_memory_figures(data, request):
    ds = open_shards(request.getfixturevalue(data))
    model, spec = _model(ds)
    whole = ds.split("validation", spec)
    source = _small_blocks(ds)
    assert len(source.sizes) >= 5 and sum(source.sizes) == len(whole.features)
    for batch in (20, 64, 5000):  # batches inside a block, across blocks, and the whole split in one
        in_memory = score_spec(model, spec, whole, batch=batch)
        assert score_spec(model, spec, source, batch=batch) == in_memory  # same rows, same batches: exactly
    assert isinstance(validation_for(ds, spec), NpyBlocks)  # what Evaluator and evaluate.run score
    assert score_spec(model, spec, validation_for(ds, spec)) == score_spec(model, spec, whole)
    labels = torch.from_numpy(whole.labels) if whole.labels is not None else None
    assert score_blocks(model, spec.kind, source, task=spec.task) == score(model, spec.kind,
                                                                            torch.from_numpy(whole.features), labels)
    if spec.task == "classification":  # the evaluation report's confusion matrix, counted batch by batch
        report = reports.evaluation_report(spec.task, spec.kind, model, _batches(source, 100))
        assert report == reports.evaluation_report(spec.task, spec.kind, model, _batches(whole))
        assert report["rows"] == len(whole.features)
        first = ds.split("validation", limit=3)  # the registry's input example: the first rows only
        assert (first.labels == whole.labels[:3]).all() and (first.features == whole.features[:3]).all()
    other = ModelSpec.for_data("transformer", {**ds.meta, "seq_len": SEQ * 2}, hidden=16, depth=1, n_heads=2)
    with pytest.raises(ConfigError) as err:
        validation_for(ds, other)
    assert err.value.field == "seq_len"


def _evaluator(ds: TokenDataset, info, model: torch.nn.Module, spec: ModelSpec) -> tuple[Evaluator, dict]:
    """The trainer's Evaluator, with its figures caught by its own ``on_eval`` hook."""
    from types import SimpleNamespace

    cfg = TrainConfig(dataset_uri="x", model="transformer", batch_size=8, eval_every=1)
    logged: dict = {}
    metrics = SimpleNamespace(log_metrics=lambda res, step: logged.update(res))
    recorder = SimpleNamespace(not_training=lambda s: None)
    ev = Evaluator(cfg, info, model, spec, ds, metrics_log=metrics, clock=None, recorder=recorder,
                   phase=lambda name: contextlib.nullcontext())
    got: dict = {}
    ev.on_eval.append(lambda step, res: got.update(res))
    return ev, got


def _ranks(uri: str, out: str) -> None:
    """One rank of the torchrun test: the Evaluator streamed, and the in-memory split scored alike."""
    from training.distributed import parallel

    torch.set_num_threads(1)
    info = parallel.init(120)
    ds = SmallBlocks(open_shards(uri))
    model, spec = _model(ds)
    ev, got = _evaluator(ds, info, model, spec)
    ev.maybe_eval(1)
    whole = ds.split("validation", spec)
    in_memory = score_spec(model, spec, whole, batch=256, rank=info.rank, world_size=info.world_size)
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(
        {"streamed": got, "in_memory": in_memory, "reads": ds.reads, "sizes": _small_blocks(ds).sizes}))
    parallel.cleanup()
    parallel.release()


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_two_ranks_stream_only_their_share_and_get_the_in_memory_figures(lm, tmp_path):
    from tests.conftest import free_port  # here: the measured programs below need none of conftest's imports

    cmd = torchrun_command([], nproc_per_node=2, master_port=free_port(),
                           entry=["-m", "tests.training.test_evaluate_stream", "ranks", lm, str(tmp_path)])
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # Every rank gets the whole split's figures; streamed exactly as the same shares scored in memory.
    assert r0["streamed"] == r1["streamed"]
    assert {k: r0["streamed"][k] for k in r0["in_memory"]} == r0["in_memory"] == r1["in_memory"]
    assert {"eval/loss", "eval/accuracy", "eval/perplexity", "eval/bits_per_byte"} <= set(r0["streamed"])
    # One process scoring the whole split batches it otherwise: equal up to float summation order.
    ds = open_shards(lm)
    model, spec = _model(ds)
    whole = score_spec(model, spec, ds.split("validation", spec), batch=256)
    assert r0["streamed"]["eval/loss"] == pytest.approx(whole["eval/loss"], rel=1e-6)
    assert r0["streamed"]["eval/accuracy"] == pytest.approx(whole["eval/accuracy"], abs=1e-4)
    # A rank reads only the blocks its contiguous half of the rows touches.
    starts = np.concatenate([[0], np.cumsum(r0["sizes"])])
    n = int(starts[-1])
    for rank, r in enumerate((r0, r1)):
        lo, hi = n * rank // 2, n * (rank + 1) // 2
        mine = {b for b in range(len(r["sizes"])) if starts[b] < hi and starts[b + 1] > lo}
        read = {b for ids in r["reads"] for b in ids}
        assert read == mine, (rank, sorted(read - mine), sorted(mine - read))
    print(f"2 ranks, {len(r0['sizes'])} blocks, reads {len(r0['reads'])} + {len(r1['reads'])}: {r0['streamed']}")


class BagOfTokens(torch.nn.Module):
    """A document classifier as cheap as one can be (mean of token embeddings, then a linear head),
    so that a split of tens of MiB scores in seconds: what is measured here is evaluation's memory."""

    def __init__(self, vocab: int, classes: int, pad: int):
        super().__init__()
        self.pad = pad
        self.embed = torch.nn.EmbeddingBag(vocab, 8, mode="mean", padding_idx=pad)
        self.head = torch.nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _status_bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) << 10  # kB


def _memory(uri: str, mode: str) -> None:
    """Peak resident-set growth of evaluating (``stream``: the Evaluator) or of loading the
    validation split (``load``), past a baseline that already ran one batch through the model."""
    from training.distributed.parallel import DistInfo

    torch.set_num_threads(1)
    ds = open_shards(uri)
    spec = ModelSpec.for_data("transformer", ds.meta, hidden=8, depth=1, n_heads=2)
    torch.manual_seed(0)
    model = BagOfTokens(spec.vocab_size, spec.n_classes, spec.pad_id)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    ev, got = _evaluator(ds, info, model, spec)
    with torch.no_grad():
        model(torch.zeros((256, SEQ), dtype=torch.int64))
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak (VmHWM) restarts from the resident set now
    base = _status_bytes("VmRSS")
    if mode == "stream":
        ev.maybe_eval(1)
    else:
        ds.split("validation", spec)
    grew = _status_bytes("VmHWM") - base
    print(json.dumps({"grew": grew, "bytes": (ds.folder / "validation.npy").stat().st_size, "figures": got}))


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_evaluation_memory_does_not_grow_with_the_validation_split(classes, tmp_path):
    """Validation shards of ~1 MiB and ~20 MiB (uint16 ids: ~100 MiB as the int64 rows a whole
    split in memory would be): evaluating either grows the peak resident set by far less than
    ``GROWTH_BOUND``, while loading the larger split whole grows it past that bound."""
    folder = Path(classes.removeprefix("file://"))
    runs = {}
    for size in (1, 20):
        copy = tmp_path / f"x{size}"
        shutil.copytree(folder, copy)
        grow_token_shards(copy, size << 20, "validation")
        for mode in ("stream", "load") if size == 20 else ("stream",):
            proc = subprocess.run([sys.executable, "-m", "tests.training.test_evaluate_stream", "memory", str(copy),
                                   mode], capture_output=True, text=True, timeout=120, cwd=ROOT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[size, mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    small, big, load = runs[1, "stream"], runs[20, "stream"], runs[20, "load"]
    print({f"x{s} {m}": f"{r['bytes'] >> 20} MiB of shard, peak RSS +{r['grew'] / 2**20:.1f} MiB"
           for (s, m), r in runs.items()})
    assert big["bytes"] >= 19 * small["bytes"]
    # The same documents repeated: the same figures whatever the size.
    assert big["figures"]["eval/accuracy"] == pytest.approx(small["figures"]["eval/accuracy"], abs=1e-3)
    assert small["grew"] < GROWTH_BOUND and big["grew"] < GROWTH_BOUND, runs
    assert load["grew"] > GROWTH_BOUND, runs  # the measurement sees a split held whole


if __name__ == "__main__":
    {"ranks": _ranks, "memory": _memory}[sys.argv[1]](*sys.argv[2:])
