"""Data larger than the memory limit trains, and resumes exactly: token shards bigger than the
whole job's memory limit (the torchrun agent and both ranks in one cgroup, as a pod's processes
are) stream block by block; a rank SIGKILLed mid-shard restarts the group, which resumes from the
newest checkpoint and ends bit-identical to an uninterrupted run under the same limit."""

from pathlib import Path

import pytest

from tests import memlimit
from tests.training.test_text_resume import _final, _losses
from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.synthetic import grow_token_shards, make_text_dataset
from training.data.tokenizer import resolve
from training.data.tokens import build

LIMIT = 1536 << 20  # the job's limit: agent + 2 ranks (they peak near 700 MiB; the memory preflight wants ~1.3 GiB at the restart)
DATA = LIMIT + (256 << 20)  # train.npy's bytes: larger than the limit
STEPS = 30


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    make_text_dataset(root / "data")
    ds = open_dataset(root / "data", DataOptions(text_column="text"))
    tok = resolve("bytes", train_documents=lambda: [])
    uri = build(ds, text_column="text", tokenizer=tok, seq_len=32, store_uri=str(root / "store")).uri
    n = grow_token_shards(uri.removeprefix("file://"), DATA)
    return root / "data", uri, n


def _sets(data, uri, root):
    return {"dataset_uri": data, "text_column": "text", "token_shards": uri, "model": "transformer", "hidden": 32,
            "depth": 1, "n_heads": 2, "seq_len": 32, "dropout": 0.1, "steps": STEPS, "checkpoint_every": 10,
            "batch_size": 16, "log_every": 5, "warmup_steps": 5, "eval_every": 0, "target_metric": "none",
            "checkpoint_dir": root / "ck", "output_dir": root / "out", "shuffle_window": 4}


def resumes_bit_identical_under(limit: int, sets_for, tmp_path, steps: int = STEPS) -> None:
    """Under one memory group of ``limit`` (the torchrun agent and 2 ranks, as a pod's processes):
    a run of ``sets_for(folder)`` (``steps`` steps, checkpoints every 10), and the same run with
    rank 1 SIGKILLed after step 15 and restarted once, end bit-identical, nothing OOM-killed."""
    base, killed = tmp_path / "base", tmp_path / "killed"
    with memlimit.MemoryGroup("dtp-resume", limit) as group:
        memlimit.torchrun_in(group, sets_for(base))
        proc = memlimit.torchrun_in(group, sets_for(killed), max_restarts=1,
                                    env={"TRAINING_FAULT_KILL_AT_STEP": "15:1"})
        assert group.oom_kills == 0, "a process of the job was OOM-killed"
        print(f"peak of the job's memory group: {group.peak / 2**20:.0f} MiB (limit {limit >> 20} MiB)")
    assert "rank 1 SIGKILLs itself after step 15" in proc.stdout and "(step 10)" in proc.stdout
    assert _final(killed, steps) == _final(base, steps)
    got, want = _losses(killed), _losses(base)
    assert [got[s] for s in range(11, steps + 1)] == [want[s] for s in range(11, steps + 1)]


@pytest.mark.slow
@pytest.mark.skipif(not memlimit.available(), reason="needs root and the cgroup v1 memory controller")
def test_data_larger_than_the_memory_limit_trains_and_resumes_bit_identical(big_shards, tmp_path):
    data, uri, windows = big_shards
    assert (Path(uri.removeprefix("file://")) / "train.npy").stat().st_size > LIMIT
    resumes_bit_identical_under(LIMIT, lambda root: _sets(data, uri, root), tmp_path)
