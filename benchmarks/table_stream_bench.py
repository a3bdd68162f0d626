"""Tables larger than memory, two figures in one run (``--parts`` picks):

1. memory against the table's size: the real trainer (torchrun, 2 gloo ranks, the demo's MLP) on
   a Parquet table of 1x, 10x and 50x ``--base-mb`` MiB of float32 features (train/ and validation/
   folders, no dataset.json: the description and the normalization statistics are inferred, each a
   pass over row groups); each rank's peak resident set (the run summary's
   ``peak_mem_bytes_rank_<r>``), its growth from 1x, and the start-up time the passes add.
2. throughput on the demo's configuration (TrainConfig defaults: the MLP, hidden 128, depth 2, a
   rank's share of the global batch of 64 with 2 ranks): samples/s of the training step with its
   rows streamed from the Parquet row groups (``ParquetBlocks`` through ``StreamLoader``) against the
   same rows indexed in memory, in the same order (checked), rounds alternated.

    .venv/bin/python benchmarks/table_stream_bench.py [--base-mb 32] [--sizes 1,10,50] [--steps 400]
        [--features 16] [--group-rows 65536] [--parts memory,throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.stream_bench import alternate, print_growth, run_trainer  # noqa: E402


def write_table(root: Path, rows: int, *, features: int, group_rows: int, seed: int = 0) -> None:
    """train/part-0.parquet of ``rows`` rows (standard normal float32 features, a linear teacher's
    3 classes as the label ``label``) in row groups of ``group_rows``; validation/ of 2,000 rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    w = rng.normal(size=(features, 3)).astype(np.float32)
    names = [f"f{i}" for i in range(features)]
    schema = pa.schema([*(pa.field(n, pa.float32()) for n in names), pa.field("label", pa.int64())])

    def group(n: int):
        x = rng.standard_normal((n, features), dtype=np.float32)
        return pa.table([*x.T, np.argmax(x @ w, axis=1).astype(np.int64)], schema=schema)

    for split, n in (("train", rows), ("validation", 2_000)):
        (root / split).mkdir(parents=True)
        with pq.ParquetWriter(root / split / "part-0.parquet", schema) as out:
            for a in range(0, n, group_rows):
                out.write_table(group(min(group_rows, n - a)), row_group_size=group_rows)


def memory_by_size(a, tmp: Path) -> list[dict]:
    row_bytes = a.features * 4
    rows_out = []
    for k in a.sizes:
        data = tmp / f"table-{k}x"
        rows = (k * a.base_mb << 20) // row_bytes
        write_table(data, rows, features=a.features, group_rows=a.group_rows)
        sets = {"dataset_uri": data, "label_column": "label", "steps": a.steps, "log_every": 100, "eval_every": 0,
                "target_metric": "none", "checkpoint_every": a.steps, "checkpoint_dir": tmp / f"ck-{k}",
                "output_dir": tmp / f"out-{k}"}
        t0 = time.perf_counter()
        summary, proc = run_trainer(sets)
        memory = json.loads((tmp / f"out-{k}" / "memory.json").read_text())
        peaks = [summary[f"peak_mem_bytes_rank_{r}"] / 2**20 for r in range(2)]
        size = (data / "train" / "part-0.parquet").stat().st_size / 2**20
        data_term = memory["estimate"]["terms_bytes"]["data"] / 2**20
        found = re.search(r"startup: .*?\bdata ([0-9.]+)s", proc.stdout + proc.stderr)
        data_s = float(found.group(1)) if found else None  # the description and statistics passes, rank 0
        rows_out.append({"x": k, "rows": rows, "parquet_mib": size, "peaks": peaks, "data_term_mib": data_term,
                         "s": time.perf_counter() - t0, "data_s": data_s})
        print(f"{k:>3}x  {rows:>9} rows, {size:6.0f} MiB Parquet ({rows * row_bytes / 2**20:.0f} MiB as float32)  "
              f"peak RSS rank 0 {peaks[0]:.0f} MiB, rank 1 {peaks[1]:.0f} MiB  (preflight data term {data_term:.0f} MiB; "
              f"rank 0's data phase at start {data_s} s; run {rows_out[-1]['s']:.0f} s)",
              flush=True)
        shutil.rmtree(data)
    print_growth(rows_out)
    return rows_out


def throughput(a, tmp: Path) -> float:
    import torch

    from training.config.train_config import TrainConfig
    from training.data.dataset import open_dataset
    from training.data.options import DataOptions
    from training.data.sampler import ShardedSampler
    from training.data.stream import StreamLoader
    from training.models.build import build_model
    from training.models.loss import loss_fn, split_batch
    from training.models.spec import ModelSpec

    torch.set_num_threads(1)  # as a rank under torchrun (OMP_NUM_THREADS=1)
    data = tmp / "table"
    write_table(data, a.rows, features=a.features, group_rows=a.group_rows)
    cfg = TrainConfig(dataset_uri=str(data), label_column="label")
    ds = open_dataset(data, DataOptions.of(cfg))
    head, blocks = ds.stream("train", cfg.shuffle_window)
    spec = ModelSpec.for_data(cfg.model, ds.meta, hidden=cfg.hidden, depth=cfg.depth, train=head)
    whole = ds.split("train")
    features, labels = torch.from_numpy(whole.features), torch.from_numpy(whole.labels)
    n, world, window = len(whole.features), 2, blocks.window_for(cfg.shuffle_window)

    def sampler(streamed: bool):
        return ShardedSampler(n, global_batch=cfg.batch_size, rank=0, world_size=world, seed=cfg.seed,
                              blocks=blocks.sizes if streamed else None, window=window if streamed else 1)

    torch.manual_seed(0)
    model = build_model(spec).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)

    def step(x, y):
        inputs, target = split_batch(spec.kind, x, y)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(inputs), target, task=spec.task, target_var=spec.target_variance).backward()
        opt.step()

    def memory_batches():
        s = sampler(True)  # the streamed order, rows indexed from memory
        while True:
            idx = torch.from_numpy(s.next_indices())
            yield features[idx], labels[idx]

    def streamed_batches():
        loader = StreamLoader(blocks, sampler(True))
        while True:
            x, y = loader.next_batch()
            yield torch.from_numpy(x), torch.from_numpy(y)

    check_m, check_s = memory_batches(), streamed_batches()
    window_rows = window * a.group_rows
    for _ in range(2 * window_rows // cfg.batch_size + 5):  # into the third shuffle window
        (xm, ym), (xs, ys) = next(check_m), next(check_s)
        assert torch.equal(xm, xs) and torch.equal(ym, ys), "streamed rows differ from the rows in memory"
    print(f"throughput: demo config ({cfg.model}, hidden {cfg.hidden}, depth {cfg.depth}, {cfg.batch_size // world} "
          f"rows per rank and step), {n} rows x {a.features} features ({n * a.features * 4 / 2**20:.0f} MiB), "
          f"{len(blocks.sizes)} row groups of {a.group_rows}, {window} a window (shuffle_window {cfg.shuffle_window}); "
          "same order checked", flush=True)
    return alternate(a, {"in memory": memory_batches, "streamed": streamed_batches}, step, cfg.batch_size // world)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-mb", type=int, default=32, help="the 1x table's float32 features, MiB")
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 10, 50])
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--group-rows", type=int, default=65_536)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the throughput table")
    ap.add_argument("--timed-steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="memory,throughput")
    a = ap.parse_args()
    print(f"[load {os.getloadavg()[0]:.2f}, {os.cpu_count()} cpus]")
    with tempfile.TemporaryDirectory(prefix="table-stream-bench-") as tmp:
        if "throughput" in a.parts:
            (Path(tmp) / "t").mkdir()
            throughput(a, Path(tmp) / "t")
        if "memory" in a.parts:
            (Path(tmp) / "m").mkdir()
            memory_by_size(a, Path(tmp) / "m")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
