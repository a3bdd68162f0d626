"""Overhead of the trainer against a bare hand-written DDP loop: same model, same data, same
batch, same ranks, in the same invocation. Goal: trainer / bare >= 0.97.

    .venv/bin/python benchmarks/overhead_bench.py [--model mlp|transformer] [--world 2] [--steps 600] [--repeats 5]

The bare loop (``--bare``, run under torchrun by this script) is what one would write by hand
for the same recipe: DDP with the default all-reduce, AdamW, the same warm-up/cosine LR schedule
and gradient clipping as the trainer's defaults, zero_grad / forward / backward / clip / step /
schedule, nothing else. So both do the same arithmetic and the ratio is the price of what the
trainer adds: the comm timing hook, the preemption agreement, the per-step record, window
metrics and progress lines (run without MLflow). Both skip the first ``--log-every`` steps (warm-up) and time the rest as the
slowest rank saw it. Runs alternate (trainer, bare, trainer, bare, ...) so that drift in the
machine's load hits both; the ratio printed is the median of the per-pair ratios.
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

from training.launch import TRAIN, torchrun_command  # noqa: E402 (after the path is set)
from training.util import free_port  # noqa: E402

PROGRESS = re.compile(r"^step (\d+)/\d+ \| loss [0-9.]+ \| (\d+) samples/s", re.M)


def _torchrun(world: int, args: list[str], entry=TRAIN) -> str:
    cmd = torchrun_command(args, nproc_per_node=world, master_port=free_port(), entry=entry)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_RUN_ID", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return out.stdout


def _model_sets(a) -> dict:
    sets = {"model": a.model, "batch_size": a.batch_size, "hidden": a.hidden, "depth": a.depth}
    if a.model == "transformer":
        sets["n_heads"] = 4
    return sets


def trainer_rate(a, data: Path, tmp: Path, i: int) -> float:
    sets = {**_model_sets(a), "dataset_uri": data, "steps": a.steps, "log_every": a.log_every, "checkpoint_every": 0,
            "checkpoint_dir": tmp / f"ck{i}", "output_dir": tmp / f"out{i}"}
    out = _torchrun(a.world, [x for k, v in sets.items() for x in ("--set", f"{k}={v}")])
    lines = [(int(s), int(r)) for s, r in PROGRESS.findall(out)]
    # Samples over window time after the first (warm-up) interval, as the bare loop is timed.
    samples = sum(a.batch_size * (b[0] - p[0]) for p, b in zip(lines, lines[1:]))
    seconds = sum(a.batch_size * (b[0] - p[0]) / b[1] for p, b in zip(lines, lines[1:]))
    return samples / seconds


def bare_rate(a, data: Path) -> float:
    out = _torchrun(a.world, ["--bare", "--data", str(data),
                              *[x for k, v in _model_sets(a).items() for x in (f"--{k.replace('_', '-')}", str(v))],
                              "--steps", str(a.steps), "--log-every", str(a.log_every)], entry=[str(Path(__file__).resolve())])
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def bare_loop(a) -> None:
    """The hand-written loop (one rank)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from training.config import TrainConfig
    from training.data import ShardedSampler, load_split
    from training.datasets import read_meta
    from training.models import build_model, loss_fn, model_spec, split_batch
    from training.train import lr_lambda

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    meta = read_meta(a.data)
    train = load_split(a.data, "train")
    model = DDP(build_model(model_spec(a.model, meta, hidden=a.hidden, depth=a.depth, n_heads=a.n_heads, dropout=0.0)))
    recipe = TrainConfig(steps=a.steps, dataset_uri=a.data, checkpoint_dir="unused")  # the trainer's default lr, weight decay, schedule, clipping
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe))
    sampler = ShardedSampler(len(train.features), global_batch=a.batch_size, rank=rank, world_size=world, seed=1234)
    x = torch.from_numpy(train.features)
    y = torch.from_numpy(train.labels) if train.labels is not None else None
    kind = meta["kind"]
    for step in range(a.steps):
        if step == a.log_every:
            t0 = time.perf_counter()
        idx = torch.from_numpy(sampler.next_indices())
        inputs, target = split_batch(kind, x[idx], y[idx] if y is not None else None)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(inputs), target).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        sched.step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"samples_per_s": a.batch_size * (a.steps - a.log_every) / float(elapsed)}), flush=True)
    # Leave without tearing the group down: when the last reference to the DDP model goes at
    # interpreter exit after destroy_process_group, ~ProcessGroupGloo joins its worker threads
    # with the GIL held while a worker may still need the GIL to release the last all-reduce's
    # tensor (a deadlock seen here in about 1 run in 3). The measurement is complete at this point.
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bare:
        bare_loop(a)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="overhead-bench-"))
    data = tmp / "data"
    kind = ["--kind", "markov", "--train-rows", "4000", "--val-rows", "100"] if a.model == "transformer" else []
    subprocess.run([sys.executable, "-m", "training", "make-data", "--out", str(data), *kind], check=True,
                   capture_output=True, cwd=ROOT)
    print(f"{a.model} hidden={a.hidden} depth={a.depth}, batch {a.batch_size}, {a.world} ranks, {a.steps} steps "
          f"(first {a.log_every} not timed)")
    ratios = []
    for i in range(a.repeats):
        ours = trainer_rate(a, data, tmp, i)
        bare = bare_rate(a, data)
        ratios.append(ours / bare)
        print(f"  pair {i + 1}: trainer {ours:8.0f} samples/s | bare loop {bare:8.0f} samples/s | ratio {ours / bare:.3f}",
              flush=True)
    print(f"trainer / bare loop (median of {a.repeats} pairs): {statistics.median(ratios):.3f}  (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
