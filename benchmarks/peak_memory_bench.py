"""Each rank's measured peak memory beside the preflight's estimate, for the built-in decoder by
strategy x world size x activation checkpointing: real ``torchrun`` runs of the trainer on token
windows (a Markov dataset), a few steps each; the measured peak is the rank's maximum resident set
at the last log window (``output_dir/memory.json``, which also holds the estimate's terms). Also
the FSDP goal of issue 24: per-rank peak <= full training state / N + the largest unit + a fixed
baseline (the measured resident set of a rank before its model).

    .venv/bin/python benchmarks/peak_memory_bench.py [--d-model 1024 --layers 12 --vocab 4096] \
        [--seq-len 128] [--batch 4] [--steps 3] [--json out.json]
    .venv/bin/python benchmarks/peak_memory_bench.py --malloc --d-model 512 --layers 4 --vocab 8192 --steps 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def run_one(data: Path, work: Path, *, strategy: str, world: int, ac: str, a) -> dict:
    from training.distributed.launch import torchrun_command
    from training.util import free_port

    out = work / f"{strategy}-{world}-{ac}"
    sets = [f"dataset_uri={data}", "model=transformer", f"hidden={a.d_model}", f"depth={a.layers}",
            f"n_heads={a.heads}", f"strategy={strategy}", f"activation_checkpointing={ac}", f"batch_size={a.batch * world}",
            f"steps={a.steps}", f"log_every={a.steps}", "checkpoint_every=0", "warmup_steps=0",
            f"checkpoint_dir={out / 'ckpt'}", f"output_dir={out}"]
    cmd = torchrun_command([x for s in sets for x in ("--set", s)], nproc_per_node=world, master_port=free_port())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy}/{world}/{ac} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    mem = json.loads((out / "memory.json").read_text())
    return {"strategy": strategy, "world_size": world, "activation_checkpointing": ac,
            "estimate_bytes": mem["estimate"]["total_bytes"], "terms": mem["estimate"]["terms_bytes"],
            "setup": mem["estimate"]["setup"],
            "peak_bytes_rank": mem["peak_bytes_rank"], "seconds": time.perf_counter() - t0}


def baseline_rss() -> int:
    """A rank's resident set before its model: the trainer's imports and a gloo process group."""
    code = ("import os, torch, torch.distributed as dist, training.train\n"
            "from training.metrics.memory import tame_malloc\ntame_malloc()\n"
            "from training.util import free_port\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))\n"
            "dist.init_process_group('gloo', rank=0, world_size=1)\n"
            "dist.all_reduce(torch.ones(1))\n"
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))\n")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                              cwd=ROOT).stdout.split()[-1])


def agent_rss() -> int:
    """The torchrun agent's resident set while its rank runs."""
    from training.util import free_port

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
                             "127.0.0.1", "--master-port", str(free_port()), "--no-python", "sleep", "4"], env=env)
    from training.metrics.preflight import rss

    best = 0
    while proc.poll() is None:
        best = max(best, rss(proc.pid))
        time.sleep(0.2)
    return best


MALLOC_STEP = """
import resource, sys, time, torch
from training.metrics.memory import tame_malloc
threshold = int(sys.argv[1])
if threshold:
    tame_malloc(threshold)
from training.models.builtin import Transformer
torch.manual_seed(0)
d, layers, vocab, seq, batch, steps = map(int, sys.argv[2:8])
model = Transformer(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x = torch.randint(0, vocab, (batch, seq + 1))
cpu0 = time.process_time()
for _ in range(steps):
    out = model(x[:, :-1])
    torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.process_time() - cpu0)
"""


def malloc_check(a) -> None:
    """A training loop in one process with glibc's default thresholds, 4 MiB and 1 MiB: the
    resident-set peak and the CPU time of the steps (alternating rounds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(v) for v in (a.d_model, a.layers, a.vocab, a.seq_len, a.batch, a.steps)]
    seen: dict[int, list[tuple[int, float]]] = {0: [], 4 * MiB: [], 1 * MiB: []}
    for _ in range(a.rounds):
        for threshold in seen:
            out = subprocess.run([sys.executable, "-c", MALLOC_STEP, str(threshold), *args], capture_output=True,
                                 text=True, check=True, env=env, cwd=ROOT).stdout.split()
            seen[threshold].append((int(out[-2]), float(out[-1])))
    for threshold, runs in seen.items():
        name = f"{threshold // MiB} MiB" if threshold else "glibc default"
        print(f"malloc thresholds {name:>13}: peak RSS {min(r[0] for r in runs) / MiB:.0f}-{max(r[0] for r in runs) / MiB:.0f} "
              f"MiB, step CPU {min(r[1] for r in runs):.2f}-{max(r[1] for r in runs):.2f} s over {len(runs)} runs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--ac", default="none,full")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--malloc", action="store_true", help="only compare glibc's malloc thresholds in one process")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.malloc:
        malloc_check(a)
        return 0

    from training.data.synthetic import make_markov_dataset

    base, agent = baseline_rss(), agent_rss()  # VmHWM, not ru_maxrss: that survives exec from this process
    work = Path(tempfile.mkdtemp(prefix="peak-mem-"))
    data = work / "data"
    make_markov_dataset(data, n_train=a.rows, n_val=8, vocab=a.vocab, seq_len=a.seq_len, seed=0)
    rows = []
    try:
        for strategy, world, ac in itertools.product(a.strategies.split(","), map(int, a.worlds.split(",")),
                                                     a.ac.split(",")):
            r = run_one(data, work, strategy=strategy, world=world, ac=ac, a=a)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "terms"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the runs' checkpoints: gigabytes for the 160M decoder

    params = rows[0]["terms"]["parameters"] * (rows[0]["world_size"] if rows[0]["strategy"] == "fsdp" else 1)
    n_params = params // 4
    print(f"\ndecoder d_model={a.d_model} layers={a.layers} vocab={a.vocab}: {n_params / 1e6:.1f}M parameters; "
          f"seq_len {a.seq_len}, {a.batch} samples per rank, {a.steps} steps; rank baseline {base / MiB:.0f} MiB, "
          f"torchrun agent {agent / MiB:.0f} MiB")
    print("| strategy | ranks | AC | measured peak / rank (MiB) | estimate (MiB) | estimate / measured | FSDP goal (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = max(r["peak_bytes_rank"])
        goal = ""
        if r["strategy"] == "fsdp":
            t = r["terms"]
            state = (t["parameters"] + t["gradients"] + t["optimizer"]) * r["world_size"]
            unit = r["setup"]["largest_unit_parameters"] * 4
            bound = state / r["world_size"] + unit + base
            goal = f"{bound / MiB:.0f}: {'met' if peak <= bound else 'not met'}"
        print(f"| {r['strategy']} | {r['world_size']} | {r['activation_checkpointing']} | {peak / MiB:.0f} | "
              f"{r['estimate_bytes'] / MiB:.0f} | {r['estimate_bytes'] / peak:.2f} | {goal} |")
    if a.json:
        a.json.write_text(json.dumps({"baseline_bytes": base, "agent_bytes": agent, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
