"""Tables stream row group by row group: the rows a rank trains on, in the sampler's global order,
are the split's rows as the whole-table path reads them; the description and the normalization
statistics computed one row group at a time equal the whole split's; a window holds about
``shuffle_window`` MiB of rows, whatever the table's size; a resume from a global position and a
smaller world size with the same global batch give the same global order."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.data.dataset import open_dataset
from training.data.options import DataOptions
from training.data.sampler import ShardedSampler
from training.data.schema import describe
from training.data.stream import StreamLoader
from training.models.spec import ModelSpec, column_stats

N = 6_000


def _table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"a": rng.normal(size=n) * 3 + 1, "b": rng.integers(-50, 50, size=n),
                     "c": rng.normal(size=n).astype(np.float32), "y": rng.integers(0, 4, size=n),
                     "target": rng.normal(size=n) * 10 - 3})


def _write(path, table, group_rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=group_rows)


@pytest.fixture(params=["one table", "folders"])
def layout(request, tmp_path):
    """A table in row groups of 500 rows (one table to split, or train/ in two files)."""
    if request.param == "one table":
        _write(tmp_path / "data.parquet", _table(N), 500)
    else:
        t = _table(N)
        _write(tmp_path / "train" / "part-0.parquet", t.slice(0, 3_700), 500)
        _write(tmp_path / "train" / "part-1.parquet", t.slice(3_700, 1_300), 500)
        _write(tmp_path / "validation" / "part-0.parquet", t.slice(5_000), 500)
    return tmp_path


def _epoch(blocks, *, window: int, seed: int = 7, world: int = 1, pos: int = 0, batch: int | None = None):
    """Every rank's batches of one epoch from ``pos``, merged in the global order."""
    n = sum(blocks.sizes)
    batch = batch or n
    loaders = [StreamLoader(blocks, ShardedSampler(n, global_batch=batch, rank=r, world_size=world, seed=seed,
                                                   pos=pos, blocks=blocks.sizes, window=window)) for r in range(world)]
    xs, ys = [], []
    while loaders[0].sampler.pos < n:
        for loader in loaders:
            x, y = loader.next_batch()
            xs.append(x)
            ys.append(y)
    for loader in loaders:
        loader.close()
    return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.parametrize("task, label", [("auto", "y"), ("regression", "target")])
def test_streamed_rows_description_and_statistics_match_the_whole_split(layout, task, label):
    options = DataOptions(label_column=label, task=task)
    ds = open_dataset(layout, options)
    whole_table = ds.table("train")
    assert ds.meta == describe(None, options, lambda: whole_table)  # row group by row group == whole
    whole = ds.split("train")
    head, blocks = ds.stream("train", shuffle_window=16)
    assert len(blocks.groups) > 4 and sum(blocks.sizes) == len(whole.features)
    np.testing.assert_array_equal(head.features, whole.features[:2])

    spec = ModelSpec.for_data("mlp", ds.meta, hidden=8, depth=1, train=head)
    want = ModelSpec.for_data("mlp", ds.meta, hidden=8, depth=1, train=whole)
    assert spec.normalization == want.normalization
    assert spec.target == want.target
    mean, std = head.stats["features"]
    np.testing.assert_allclose(mean, whole.features.astype(np.float64).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, whole.features.astype(np.float64).std(axis=0), rtol=1e-10)
    assert column_stats(whole.features) == (spec.normalization["mean"], spec.normalization["std"])

    # A split within one window: the same full permutation the in-memory path indexed.
    window = blocks.window_for(16)
    assert window >= len(blocks.sizes)
    x, y = _epoch(blocks, window=window)
    idx = ShardedSampler(len(whole.features), global_batch=len(whole.features), rank=0, world_size=1,
                         seed=7).next_indices()
    np.testing.assert_array_equal(x, whole.features[idx])
    np.testing.assert_array_equal(y, whole.labels[idx])
    assert y.dtype == (np.float32 if task == "regression" else np.int64)


def test_small_windows_cover_the_split_once_per_epoch_resume_and_shrink_in_the_same_order(layout):
    ds = open_dataset(layout, DataOptions(label_column="y"))
    whole = ds.split("train")
    _, blocks = ds.stream("train", shuffle_window=1)
    n = len(whole.features)
    x, y = _epoch(blocks, window=2)  # two row groups a window: blocks permuted, rows shuffled in windows
    rows = lambda a: sorted(map(tuple, a.tolist()))  # noqa: E731
    assert rows(x) == rows(whole.features) and not np.array_equal(x, whole.features)
    # Two ranks from the same global batch give the same global order, and a resume from a global
    # position mid-block continues it exactly.
    batch = 40
    x2, _ = _epoch(blocks, window=2, world=2, batch=batch)
    np.testing.assert_array_equal(x2[: n - n % batch], x[: n - n % batch])
    pos = 37 * batch
    assert pos % 500 != 0
    xr, _ = _epoch(blocks, window=2, world=2, batch=batch, pos=pos)
    np.testing.assert_array_equal(xr[: n - pos - (n - pos) % batch], x[pos : n - (n - pos) % batch])


def test_a_window_holds_about_shuffle_window_mib_and_the_estimate_counts_it(tmp_path):
    """Row groups of ~400 KiB of float32 rows: a 1 MiB window takes two of them; the loader holds
    at most two windows; the preflight's data term is two windows and one decoded group."""
    rng = np.random.default_rng(1)
    n, d = 40_000, 20
    cols = {f"f{i}": rng.normal(size=n).astype(np.float32) for i in range(d)}
    _write(tmp_path / "train" / "p.parquet", pa.table({**cols, "y": rng.integers(0, 2, size=n)}), 5_000)
    _write(tmp_path / "validation" / "p.parquet", pa.table({**{k: v[:100] for k, v in cols.items()},
                                                             "y": np.arange(100) % 2}), 5_000)
    (tmp_path / "dataset.json").write_text(json.dumps({"features": list(cols), "label": "y", "n_classes": 2,
                                                       "normalize": False}))
    ds = open_dataset(tmp_path)
    head, blocks = ds.stream("train", shuffle_window=1)
    assert head.stats == {}  # nothing to compute: the description is declared, without normalization
    row_bytes = d * 4 + 8
    assert blocks.row_bytes == row_bytes
    assert blocks.window_for(1) == (1 << 20) // (5_000 * row_bytes) == 2
    assert blocks.window_for(64) == 64 * (1 << 20) // (5_000 * row_bytes)
    assert head.held_bytes == 4 * 5_000 * row_bytes + max(g.nbytes for g in blocks.groups)
    loader = StreamLoader(blocks, ShardedSampler(n, global_batch=256, rank=0, world_size=1, seed=0,
                                                 blocks=blocks.sizes, window=2))
    for _ in range(2 * n // 256):
        loader.next_batch()
    loader.close()
    assert loader.peak_windows == 2


@pytest.mark.parametrize("task, label", [("auto", "y"), ("regression", "target")])
def test_a_tables_validation_split_scores_the_same_streamed_as_in_memory(layout, task, label):
    import torch

    from training.evaluate import score_spec, validation_for
    from training.models.build import build_model

    ds = open_dataset(layout, DataOptions(label_column=label, task=task))
    head, _ = ds.stream("train", shuffle_window=16)
    spec = ModelSpec.for_data("mlp", ds.meta, hidden=8, depth=1, train=head)
    torch.manual_seed(0)
    model = build_model(spec)
    source = validation_for(ds, spec)
    assert len(source.groups) > 1 and sum(source.sizes) == len(ds.split("validation", spec).features)
    for batch in (64, 5_000):
        assert score_spec(model, spec, source, batch=batch) == score_spec(model, spec, ds.split("validation", spec),
                                                                          batch=batch)


def test_the_passes_over_a_table_run_once_per_machine_and_data(layout, monkeypatch):
    """The ranks of one machine and a restart find the description's and the statistics' passes
    in the machine's cache; other data (another fingerprint) is passed over again."""
    import training.data.table_stream as ts

    options = DataOptions(label_column="target", task="regression")
    head, blocks = open_dataset(layout, options).stream("train", shuffle_window=16)

    def no_pass(*args, **kwargs):
        raise AssertionError("passed over the data again")

    with monkeypatch.context() as m:
        m.setattr(ts, "scan", no_pass)
        m.setattr(ts, "label_scan", no_pass)
        again = open_dataset(layout, options)
        head2, blocks2 = again.stream("train", shuffle_window=16)
    assert again.meta["task"] == "regression"
    assert blocks2.sizes == blocks.sizes
    for k in ("features", "labels"):
        np.testing.assert_array_equal(head2.stats[k][0], head.stats[k][0])
        np.testing.assert_array_equal(head2.stats[k][1], head.stats[k][1])
    # The data changes: its fingerprint too, and the passes run again.
    path = next(layout.rglob("*.parquet"))
    pq.write_table(_table(N, seed=5).slice(0, pq.ParquetFile(path).metadata.num_rows), path, row_group_size=500)
    with monkeypatch.context() as m:
        m.setattr(ts, "scan", no_pass)
        with pytest.raises(AssertionError, match="passed over the data again"):
            open_dataset(layout, options).stream("train", shuffle_window=16)
