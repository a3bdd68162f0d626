"""Data larger than memory, three figures in one run (``--parts`` picks):

1. memory against the data's size: the real trainer (torchrun, 2 gloo ranks, a small decoder) on
   token shards of 1x, 10x and 50x ``--base-mb`` MiB; each rank's peak resident set (the run
   summary's ``peak_mem_bytes_rank_<r>``) and its growth from 1x. Enough steps that every size
   moves through several shuffle windows.
2. throughput on the demo's configuration (TrainConfig defaults: the MLP, hidden 128, depth 2, a
   rank's share of the global batch of 64 with 2 ranks; the teacher dataset's rows repeated to
   ``--rows``): samples/s of the training step with its rows streamed from an ``.npy`` shard
   (``StreamLoader``) against the same rows indexed in memory, in the same order (checked),
   rounds alternated.
3. the data gate's time and peak resident set by the table's size, whole splits and in batches.

    .venv/bin/python benchmarks/stream_bench.py [--base-mb 64] [--sizes 1,10,50] [--steps 600] [--rows 1000000]
        [--gate-rows 200000] [--parts memory,throughput,gate]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def memory_by_size(a, tmp: Path) -> list[dict]:
    from training.data.dataset import open_dataset
    from training.data.options import DataOptions
    from training.data.synthetic import grow_token_shards, make_text_dataset
    from training.data.tokenizer import resolve
    from training.data.tokens import build

    make_text_dataset(tmp / "data")
    ds = open_dataset(tmp / "data", DataOptions(text_column="text"))
    built = build(ds, text_column="text", tokenizer=resolve("bytes", train_documents=lambda: []), seq_len=a.seq_len,
                  store_uri=str(tmp / "store"))
    template = Path(built.uri.removeprefix("file://"))
    rows = []
    for k in a.sizes:
        shards = tmp / f"shards-{k}x"
        shutil.copytree(template, shards)
        windows = grow_token_shards(shards, k * a.base_mb << 20)
        sets = {"dataset_uri": tmp / "data", "text_column": "text", "token_shards": shards, "model": "transformer",
                "hidden": 64, "depth": 1, "n_heads": 2, "seq_len": a.seq_len, "steps": a.steps, "batch_size": 64,
                "log_every": 100, "eval_every": 0, "target_metric": "none", "checkpoint_every": a.steps,
                "shuffle_window": a.window, "checkpoint_dir": tmp / f"ck-{k}", "output_dir": tmp / f"out-{k}"}
        t0 = time.perf_counter()
        summary, _ = run_trainer(sets)
        peaks = [summary[f"peak_mem_bytes_rank_{r}"] / 2**20 for r in range(2)]
        size = (shards / "train.npy").stat().st_size / 2**20
        rows.append({"x": k, "mib": size, "windows": windows, "peaks": peaks, "s": time.perf_counter() - t0})
        print(f"{k:>3}x  train.npy {size:8.0f} MiB ({windows} windows of {a.seq_len + 1} tokens)  peak RSS rank 0 "
              f"{peaks[0]:.0f} MiB, rank 1 {peaks[1]:.0f} MiB  ({rows[-1]['s']:.0f} s)", flush=True)
        shutil.rmtree(shards)
    print_growth(rows)
    return rows


def run_trainer(sets: dict) -> tuple[dict, subprocess.CompletedProcess]:
    """The trainer under torchrun on 2 gloo ranks with ``--set`` each of ``sets`` (``output_dir``
    among them): its run summary and the finished process; exits with its output when it fails."""
    from training.distributed.launch import torchrun_command
    from training.util import free_port

    cmd = torchrun_command([x for kv, v in sets.items() for x in ("--set", f"{kv}={v}")], nproc_per_node=2,
                           master_port=free_port())
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo",
                                                                      "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads((Path(sets["output_dir"]) / "train_summary.json").read_text()), proc


def print_growth(rows: list[dict]) -> None:
    base = rows[0]["peaks"]
    for r in rows:
        print(f"growth at {r['x']}x over 1x: " + ", ".join(f"rank {i} {p - b:+.1f} MiB" for i, (p, b) in
                                                         enumerate(zip(r["peaks"], base))))


def alternate(a, makers: dict, step, rows_per_step: int) -> float:
    """Samples/s of ``step`` on the batches each of ``makers`` (name -> a new batch iterator) gives,
    ``a.repeats`` rounds of ``a.timed_steps`` steps alternated after 50 untimed; prints the medians
    and returns the second's over the first's."""
    rates: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(a.repeats):
        for name, make in makers.items():
            batches = make()
            for _ in range(50):
                step(*next(batches))
            t0 = time.perf_counter()
            for _ in range(a.timed_steps):
                step(*next(batches))
            rates[name].append(a.timed_steps * rows_per_step / (time.perf_counter() - t0))
    (first, r1), (second, r2) = rates.items()
    m1, m2 = statistics.median(r1), statistics.median(r2)
    print(f"samples/s per rank: {first} {m1:.0f}, {second} {m2:.0f} (rounds {[round(r) for r in r1]} / "
          f"{[round(r) for r in r2]}); ratio {second} / {first} {m2 / m1:.3f}")
    return m2 / m1


def throughput(a, tmp: Path) -> float:
    import numpy as np
    import torch

    from training.config.train_config import TrainConfig
    from training.data.dataset import load_split, open_dataset
    from training.data.sampler import ShardedSampler
    from training.data.stream import NpyBlocks, StreamLoader
    from training.data.synthetic import make_teacher_dataset, write_repeated_npy
    from training.models.build import build_model
    from training.models.loss import loss_fn, split_batch
    from training.models.spec import ModelSpec

    torch.set_num_threads(1)  # as a rank under torchrun (OMP_NUM_THREADS=1)
    cfg = TrainConfig(dataset_uri=str(tmp / "teacher"))
    make_teacher_dataset(tmp / "teacher")
    train = load_split(tmp / "teacher", "train")
    meta = open_dataset(tmp / "teacher").meta
    spec = ModelSpec.for_data(cfg.model, meta, hidden=cfg.hidden, depth=cfg.depth, train=train)
    folder = tmp / "npy"
    folder.mkdir()
    reps = -(-a.rows // len(train.features))
    n = write_repeated_npy(folder / "train.npy", train.features, reps * train.features.nbytes)
    write_repeated_npy(folder / "train_labels.npy", train.labels, reps * train.labels.nbytes)
    features, labels = torch.from_numpy(np.load(folder / "train.npy")), torch.from_numpy(np.load(folder / "train_labels.npy"))
    blocks = NpyBlocks(folder, "train", dtype=np.float32)
    world = 2

    def sampler():
        return ShardedSampler(n, global_batch=cfg.batch_size, rank=0, world_size=world, seed=cfg.seed,
                              blocks=blocks.sizes, window=cfg.shuffle_window)

    torch.manual_seed(0)
    model = build_model(spec).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)

    def step(x, y):
        inputs, target = split_batch(spec.kind, x, y)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(inputs), target, task=spec.task, target_var=spec.target_variance).backward()
        opt.step()

    def memory_batches():
        s = sampler()
        while True:
            idx = torch.from_numpy(s.next_indices())
            yield features[idx], labels[idx]

    def streamed_batches():
        loader = StreamLoader(blocks, sampler())
        while True:
            x, y = loader.next_batch()
            yield torch.from_numpy(x), torch.from_numpy(y)

    check_m, check_s = memory_batches(), streamed_batches()
    window_rows = cfg.shuffle_window * blocks.per_block
    for _ in range(2 * window_rows // cfg.batch_size + 5):  # into the third shuffle window
        (xm, ym), (xs, ys) = next(check_m), next(check_s)
        assert torch.equal(xm, xs) and torch.equal(ym, ys), "streamed rows differ from the rows in memory"
    print(f"throughput: demo config ({cfg.model}, hidden {cfg.hidden}, depth {cfg.depth}, {cfg.batch_size // world} "
          f"rows per rank and step), {n} rows x {train.features.shape[1]} features ({n * train.features.shape[1] * 4 / 2**20:.0f} "
          f"MiB), {len(blocks.sizes)} blocks, shuffle_window {cfg.shuffle_window}; same order checked", flush=True)
    return alternate(a, {"in memory": memory_batches, "streamed": streamed_batches}, step, cfg.batch_size // world)


def gate_by_size(a, tmp: Path) -> None:
    """The data gate's time and peak resident set by the data's size: teacher tables of
    ``--gate-rows`` x 1, 10, 50 train rows (distinct chunks, each its own seed), whole splits and
    in batches (a pass over row groups), each gate in a fresh process."""
    import pyarrow.parquet as pq

    from training.data.synthetic import make_teacher_dataset

    base = tmp / "base"
    make_teacher_dataset(base, n_train=a.gate_rows, n_val=max(1000, a.gate_rows // 10), seed=0)
    for k in a.sizes:
        root = tmp / f"gate-{k}x"
        (root / "train").mkdir(parents=True)
        shutil.copytree(base / "validation", root / "validation")
        shutil.copy(base / "dataset.json", root / "dataset.json")
        writer = None
        for seed in range(k):  # distinct rows: a fresh draw per chunk
            chunk = tmp / f"chunk-{seed}"
            if not chunk.exists():
                make_teacher_dataset(chunk, n_train=a.gate_rows, n_val=100, seed=seed)
            table = pq.read_table(chunk / "train" / "part-00000.parquet")
            writer = writer or pq.ParquetWriter(root / "train" / "part-00000.parquet", table.schema)
            writer.write_table(table, row_group_size=256_000)
        writer.close()
        size = sum(f.stat().st_size for f in root.rglob("*.parquet")) / 2**20
        for mode in (("whole", "batched") if k <= a.gate_whole_max else ("batched",)):
            # VmHWM, not ru_maxrss: a child's ru_maxrss starts from this process's peak.
            code = ("import json, sys, time; from training.data.gate import validate; t = time.perf_counter(); "
                    f"r = validate({str(root)!r}, batch_rows={a.gate_batch_rows if mode == 'batched' else None}); "
                    "print(json.dumps({'s': time.perf_counter() - t, 'rss': next(int(v.split()[1]) * 1024 for v in "
                    "open('/proc/self/status') if v.startswith('VmHWM')), 'rows': r['rows'], "
                    "'batches': r.get('batched', {}).get('batches')}))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"gate {k:>3}x  {r['rows']['train']:>9} train rows, {size:6.0f} MiB Parquet  {mode:>7}: "
                  f"{r['s']:6.1f} s, peak RSS {r['rss'] / 2**20:5.0f} MiB  batches {r['batches']}", flush=True)
        shutil.rmtree(root)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-mb", type=int, default=64)
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 10, 50])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--window", type=int, default=4, help="shuffle_window of the memory runs")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--timed-steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gate-rows", type=int, default=200_000, help="train rows of the gate's 1x table")
    ap.add_argument("--gate-batch-rows", type=int, default=1_000_000)
    ap.add_argument("--gate-whole-max", type=int, default=10, help="largest size also gated whole")
    ap.add_argument("--parts", default="memory,throughput,gate")
    a = ap.parse_args()
    print(f"[load {os.getloadavg()[0]:.2f}, {os.cpu_count()} cpus]")
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
        if "throughput" in a.parts:
            (Path(tmp) / "t").mkdir()
            throughput(a, Path(tmp) / "t")
        if "gate" in a.parts:
            (Path(tmp) / "g").mkdir()
            gate_by_size(a, Path(tmp) / "g")
        if "memory" in a.parts:
            (Path(tmp) / "m").mkdir()
            memory_by_size(a, Path(tmp) / "m")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
