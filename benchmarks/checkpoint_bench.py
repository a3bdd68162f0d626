"""Checkpoints straight to S3: write throughput of 2 ranks against one boto3 ``upload_file``, and
how long training is blocked by an async save against a sync one.

    .venv/bin/python benchmarks/checkpoint_bench.py [--mb 256] [--rounds 5] [--steps 60]

Starts moto's S3 server on 127.0.0.1 (real HTTP) and, in the same run:

1. **Throughput.** 2 gloo ranks under torchrun hold an FSDP2-sharded model of ``--mb`` MiB (fp32
   Linear layers; each rank owns half) and save it with ``dcp.save`` through our ``StoreWriter``:
   DCP serializes each rank's shard straight into an upload (boto3's transfer manager, parts in
   parallel) while hashing it, the coordinator uploads ``.metadata`` and commits the manifest and
   ``latest``. Timed from a barrier to the commit, as the slowest rank saw it, on the second save
   of the process (a trainer saves many times; the first one, printed too, also opens connections
   and threads). Baseline: one ``client.upload_file`` of a file of the same total bytes with
   boto3's default client and TransferConfig (8 MiB parts, 10 threads), from this process. Rounds
   alternate (ours, baseline, ...) so both see the same machine load; printed: each round, MiB/s
   of each (median), and the median of the per-round ratios ours / baseline (goal: >= 1).
2. **Blocking.** The trainer on the transformer config of benchmarks/trainer_bench.py (d=128,
   4 blocks, batch 32), 2 ranks, ``checkpoint_dir=s3://...``, a save every 10 steps, once with
   ``async_checkpoint=false`` and once ``true``: the median ``training blocked`` time of the
   periodic saves and the ratio async / sync (goal: <= 0.2).

The server is a Python process on the same cores as the ranks: against a real endpoint the
network decides, so read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.local_s3 import empty_bucket, moto_s3  # noqa: E402 (after the path is set)
from benchmarks.overhead_bench import _torchrun  # noqa: E402 (torchrun on this machine, its stdout)

BUCKET = "bench"
TRANSFORMER = {"model": "transformer", "hidden": 128, "depth": 4, "n_heads": 4, "batch_size": 32, "log_every": 10}


def rank_save(a) -> None:
    """One rank of the throughput measurement (run under torchrun by ``ours``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from training.checkpoint import commit as storage
    from training.store import open_store
    from training.checkpoint.dcp_io import StoreWriter

    dist.init_process_group("gloo")
    layers = max(1, round(a.mb / 64))  # 4096 x 4096 fp32 = 64 MiB each
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    loc = storage.Location(open_store(f"s3://{BUCKET}/ours/{a.tag}"))
    sizes: list[int] = []
    seconds = []
    for step in (1, 2):  # the first save warms up (connection pool, upload threads); the second is timed
        step_dir = storage.step_dir_name(step)

        def on_commit(files, step=step, step_dir=step_dir):
            raw = json.dumps(storage.new_manifest(step=step, world_size=2, config_hash="bench", files=files)).encode()
            storage.commit(loc, step_dir, raw, step=step)
            sizes.append(sum(f["size"] for f in files))

        writer = StoreWriter(loc, step_dir, extras={}, on_commit=on_commit)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds.append(float(elapsed))
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": seconds[-1], "first_save_s": seconds[0], "bytes": sizes[-1]}), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown at exit (see overhead_bench.py's bare loop)


def throughput(a, client) -> None:
    ours_s, first_s, base_s, total = [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            res = json.loads(_torchrun(2, ["--rank-save", "--mb", str(a.mb), "--tag", str(r)],
                                       entry=[str(Path(__file__).resolve())]).strip().splitlines()[-1])
            ours_s.append(res["seconds"])
            first_s.append(res["first_save_s"])
            if not total:
                total = res["bytes"]
                blob = Path(tmp) / "blob"
                with open(blob, "wb") as f:
                    f.write(os.urandom(total))
            t0 = time.perf_counter()
            client.upload_file(str(blob), BUCKET, f"baseline/{r}")
            base_s.append(time.perf_counter() - t0)
            empty_bucket(client, BUCKET)
    mib = total / 2**20
    ours, base = statistics.median(ours_s), statistics.median(base_s)
    print(f"checkpoint of {mib:.0f} MiB, moto_server on 127.0.0.1, {a.rounds} alternating rounds, medians:")
    for i, (o, b) in enumerate(zip(ours_s, base_s)):
        print(f"  round {i + 1}: ours {o:.2f} s | boto3 {b:.2f} s | ratio {b / o:.2f}")
    print(f"  ours: 2 ranks, dcp.save -> StoreWriter (serialize, sha256, upload, manifest, latest)"
          f"  {mib / ours:7.1f} MiB/s ({ours:.2f} s)")
    print(f"  boto3 upload_file, defaults (8 MiB parts, 10 threads), one file of the same bytes"
          f"  {mib / base:7.1f} MiB/s ({base:.2f} s)")
    ratio = statistics.median(b / o for o, b in zip(ours_s, base_s))
    print(f"  ours / boto3 (median of the per-round ratios) = {ratio:.2f}  (goal >= 1)")
    print(f"  (ours, the first save of a process: {mib / statistics.median(first_s):.1f} MiB/s; it also opens the "
          "connection pool and the upload threads)")


def blocking(a) -> None:
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        data = Path(tmp) / "markov"
        subprocess.run([sys.executable, "-m", "training", "make-data", "--kind", "markov", "--out", str(data),
                        "--train-rows", "4000", "--val-rows", "100"], check=True, capture_output=True, cwd=ROOT)
        print(f"\ntraining blocked by a save every 10 steps, transformer d=128 x 4 blocks, 2 ranks, {a.steps} steps, "
              f"checkpoint_dir=s3://{BUCKET}/...:")
        blocked = {mode: _blocked(a, data, Path(tmp), mode) for mode in ("sync", "async")}
    print(f"  async / sync = {blocked['async'] / blocked['sync']:.2f}  (goal <= 0.2)")


def _blocked(a, data: Path, tmp: Path, mode: str) -> float:
    """The median time training was blocked by a periodic save (printed by the trainer)."""
    sets = {**TRANSFORMER, "dataset_uri": data, "steps": a.steps, "checkpoint_every": 10,
            "async_checkpoint": str(mode == "async").lower(), "checkpoint_dir": f"s3://{BUCKET}/trainer-{mode}",
            "output_dir": tmp / f"out-{mode}"}
    out = _torchrun(2, [x for k, v in sets.items() for x in ("--set", f"{k}={v}")])
    times = [float(x) for x in re.findall(r"training blocked ([0-9.]+)s", out)]
    print(f"  {mode:>5}: median {1000 * statistics.median(times):.1f} ms over {len(times)} saves "
          f"({', '.join(f'{1000 * t:.0f}' for t in times)} ms)")
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size in MiB (multiples of 64; default 256)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the throughput part (default 5)")
    ap.add_argument("--steps", type=int, default=60, help="trainer steps of the blocking part (default 60)")
    ap.add_argument("--skip", choices=["throughput", "blocking"], help="leave one part out")
    ap.add_argument("--rank-save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="0", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_save:
        rank_save(a)
        return 0

    with moto_s3(BUCKET) as client:
        if a.skip != "throughput":
            throughput(a, client)
        if a.skip != "blocking":
            blocking(a)
    print(f"machine load (1-min average) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0

if __name__ == "__main__":
    sys.exit(main())
