"""The trainer against what users would pick instead: a bare hand-written DDP loop and PyTorch
Lightning's DDP Trainer; same model, same data, same batch, same ranks, in the same invocation.
Goals on the demo's own configuration (the trainer's default model, global batch 64, 2 ranks):
trainer / bare >= 0.97 and trainer / Lightning >= 2.

    .venv/bin/python benchmarks/overhead_bench.py [--model mlp|transformer] [--world 2] [--steps 2000] [--repeats 5]
    .venv/bin/python benchmarks/overhead_bench.py --batch-size 256 --hidden 256 --depth 3   # a larger step

Lightning is a benchmark-only dependency (requirements-bench.txt); without it the Lightning
column is skipped.

The bare loop (``--bare``, run under torchrun by this script) is what one would write by hand
for the same recipe: DDP with the default all-reduce, AdamW, the same warm-up/cosine LR schedule
and gradient clipping as the trainer's defaults, zero_grad / forward / backward / clip / step /
schedule, nothing else. So both do the same arithmetic and the ratio is the price of what the
trainer adds: the comm timing hook, the preemption agreement, the per-step record, window
metrics and progress lines (run without MLflow). Both skip the first ``--log-every`` steps (warm-up) and time the rest as the
slowest rank saw it.

The Lightning run (``--lightning``, under torchrun like the others: Lightning's DDP strategy
joins torchrun's process group) is a ``LightningModule`` around the same model with the same
optimizer, LR schedule (stepped every step) and clipping (``gradient_clip_val``), trained by
``Trainer(strategy="ddp", accelerator="cpu")`` with its logger, checkpointing, progress bar,
model summary and sanity check off. Its data is the same in-memory split served a whole
per-rank batch at a time (a map-style dataset of batches, ``batch_size=None``), as one would
write it for data that fits in memory: per-sample indexing and collation would make Lightning
several times slower still and measure the data path, not the trainer (``--lightning-loader
samples`` measures that way: a DataLoader over a TensorDataset of rows, as Lightning's tutorials
write it). A callback times it like the bare loop. Runs alternate (trainer, bare, Lightning, trainer, ...) so that drift in the
machine's load hits all of them; each ratio printed is the median of the per-round ratios.
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

from training.distributed.launch import TRAIN, torchrun_command  # noqa: E402 (after the path is set)
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
    if not PROGRESS.search(out):
        raise RuntimeError(f"no progress line in the trainer's output:\n{out[-3000:]}")
    # From the end of the first (warm-up) steps to the end of the last, as the bare loop is timed:
    # the per-step records' timestamps (the progress lines' samples/s are whole numbers).
    t = {r["step"]: r["t"] for r in map(json.loads, (tmp / f"out{i}" / "steps.jsonl").read_text().splitlines())}
    return a.batch_size * (a.steps - a.log_every) / (t[a.steps] - t[a.log_every])


def baseline_rate(a, data: Path, mode: str) -> float:
    """samples/s of this script run under torchrun as ``--bare`` or ``--lightning``."""
    out = _torchrun(a.world, [f"--{mode}", "--data", str(data), "--lightning-loader", a.lightning_loader,
                              *[x for k, v in _model_sets(a).items() for x in (f"--{k.replace('_', '-')}", str(v))],
                              "--steps", str(a.steps), "--log-every", str(a.log_every)], entry=[str(Path(__file__).resolve())])
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def mfu(a, data: Path, samples_per_s: float) -> None:
    """The trainer's model FLOP/s utilisation against this machine's measured peak: one large
    float32 matmul (2048 x 2048) with the ranks' thread count, timed here after the rounds."""
    import torch

    from training.data.synthetic import read_meta
    from training.metrics.formulas import flops_per_sample
    from training.metrics.peak import measure_matmul_flops
    from training.models.build import build_model
    from training.models.spec import ModelSpec

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = ModelSpec.for_data(a.model, read_meta(data), hidden=a.hidden, depth=a.depth, n_heads=a.n_heads)
    n_params = sum(p.numel() for p in build_model(spec).parameters())
    peak = measure_matmul_flops(torch.device("cpu"), "fp32", n=2048)
    used = flops_per_sample(spec, n_params) * samples_per_s / a.world
    print(f"{n_params / 1e6:.1f}M parameters, seq_len {spec.seq_len}: {used / 1e9:.1f} GFLOP/s per rank of a measured "
          f"peak {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} thread matmul 2048^3): MFU {used / peak:.1%}")


def lightning_loop(a) -> None:
    """The same recipe with PyTorch Lightning's DDP Trainer (one rank of it)."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from training.config.train_config import TrainConfig
    from training.data.dataset import load_split
    from training.data.synthetic import read_meta
    from training.models.build import build_model
    from training.models.loss import loss_fn, split_batch
    from training.models.spec import ModelSpec
    from training.train import lr_lambda

    recipe = TrainConfig(steps=a.steps, dataset_uri=a.data, checkpoint_dir="unused")
    meta = read_meta(a.data)
    train = load_split(a.data, "train")
    x = torch.from_numpy(train.features)
    y = torch.from_numpy(train.labels) if train.labels is not None else None
    world = int(os.environ["WORLD_SIZE"])
    local = a.batch_size // world

    class Batches(torch.utils.data.Dataset):
        """Whole per-rank batches of a fixed permutation: one __getitem__ per step."""

        def __init__(self) -> None:
            self.perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))

        def __len__(self) -> int:
            return len(x) // local

        def __getitem__(self, i: int):
            idx = self.perm[i * local:(i + 1) * local]
            return x[idx], (y[idx] if y is not None else x[idx])

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1234)
            self.model = build_model(ModelSpec.for_data(a.model, meta, hidden=a.hidden, depth=a.depth, n_heads=a.n_heads,
                                                dropout=0.0))

        def training_step(self, batch, _):
            xb, yb = batch
            inputs, target = split_batch(meta["kind"], xb, yb if y is not None else None)
            return loss_fn(self.model(inputs), target)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if trainer.global_step == a.log_every and not hasattr(self, "t0"):
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, module) -> None:
            elapsed = torch.tensor([time.perf_counter() - self.t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if trainer.global_rank == 0:
                print(json.dumps({"samples_per_s": a.batch_size * (a.steps - a.log_every) / float(elapsed)}), flush=True)

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=a.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, gradient_clip_val=recipe.grad_clip, callbacks=[Clock()])
    if a.lightning_loader == "samples":  # the tutorial's way: a DataLoader over the rows, default collation
        rows = torch.utils.data.TensorDataset(x, y if y is not None else x)
        loader = torch.utils.data.DataLoader(rows, batch_size=local, shuffle=True, drop_last=True)
    else:
        loader = torch.utils.data.DataLoader(Batches(), batch_size=None, shuffle=True)
    trainer.fit(Module(), loader)
    sys.stdout.flush()
    os._exit(0)  # as the bare loop: the measurement is complete; no process-group teardown at exit


def bare_loop(a) -> None:
    """The hand-written loop (one rank)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from training.config.train_config import TrainConfig
    from training.data.dataset import load_split
    from training.data.sampler import ShardedSampler
    from training.data.synthetic import read_meta
    from training.models.build import build_model
    from training.models.loss import loss_fn, split_batch
    from training.models.spec import ModelSpec
    from training.train import lr_lambda

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    meta = read_meta(a.data)
    train = load_split(a.data, "train")
    model = DDP(build_model(ModelSpec.for_data(a.model, meta, hidden=a.hidden, depth=a.depth, n_heads=a.n_heads, dropout=0.0)))
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
    from training.config.train_config import TrainConfig

    ap.add_argument("--model", choices=["mlp", "transformer"], default=TrainConfig.model)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--hidden", type=int, default=TrainConfig.hidden)
    ap.add_argument("--depth", type=int, default=TrainConfig.depth)
    ap.add_argument("--n-heads", type=int, default=TrainConfig.n_heads)
    ap.add_argument("--seq-len", type=int, default=32, help="transformer: tokens per sequence of the Markov data")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-lightning", action="store_true", help="skip the Lightning runs")
    ap.add_argument("--lightning-loader", choices=["batches", "samples"], default="batches",
                    help="Lightning's data: whole batches per __getitem__ (default) or a DataLoader over rows")
    ap.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lightning", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bare:
        bare_loop(a)
        return 0
    if a.lightning:
        lightning_loop(a)
        return 0
    try:
        import lightning  # noqa: F401
    except ImportError:
        if not a.no_lightning:
            print("lightning is not installed (pip install -r requirements-bench.txt): its column is skipped")
        a.no_lightning = True
    tmp = Path(tempfile.mkdtemp(prefix="overhead-bench-"))
    data = tmp / "data"
    kind = (["--kind", "markov", "--train-rows", "4000", "--val-rows", "100", "--seq-len", str(a.seq_len)]
            if a.model == "transformer" else [])
    subprocess.run([sys.executable, "-m", "training", "make-data", "--out", str(data), *kind], check=True,
                   capture_output=True, cwd=ROOT)
    print(f"{a.model} hidden={a.hidden} depth={a.depth}, batch {a.batch_size}, {a.world} ranks, {a.steps} steps "
          f"(first {a.log_every} not timed)  [load {os.getloadavg()[0]:.2f}]")
    ratios, lightning_ratios, rates = [], [], []
    for i in range(a.repeats):
        ours = trainer_rate(a, data, tmp, i)
        rates.append(ours)
        bare = baseline_rate(a, data, "bare")
        ratios.append(ours / bare)
        line = f"  round {i + 1}: trainer {ours:8.4g} samples/s | bare loop {bare:8.4g} | trainer/bare {ours / bare:.3f}"
        if not a.no_lightning:
            light = baseline_rate(a, data, "lightning")
            lightning_ratios.append(ours / light)
            line += f" | Lightning {light:8.0f} | trainer/Lightning {ours / light:.2f}"
        print(f"{line}  [load {os.getloadavg()[0]:.2f}]", flush=True)
    print(f"trainer / bare loop (median of {a.repeats} rounds): {statistics.median(ratios):.3f}  (goal >= 0.97)")
    if a.model == "transformer":
        mfu(a, data, statistics.median(rates))
    if lightning_ratios:
        print(f"trainer / Lightning (median of {a.repeats} rounds): {statistics.median(lightning_ratios):.2f}  (goal >= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
