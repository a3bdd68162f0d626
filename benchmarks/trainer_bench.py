"""Throughput of every strategy x precision x comm_hook on the transformer, at 1 and 2 ranks, and
the time training is blocked by an async checkpoint against a synchronous one of the same state.

    .venv/bin/python benchmarks/trainer_bench.py [--steps 60] [--worlds 1 2] [--out results.json]

Each point is a real `torchrun` run (gloo on CPU, nccl on GPUs) over the same Markov token data;
samples/s is the mean of the progress lines after the first (warm-up) interval. Ratios are
against ddp/fp32/none at the same world size, measured in the same invocation.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.distributed.launch import torchrun_command  # noqa: E402 (after the path is set)
from training.util import free_port  # noqa: E402

COMBOS = [("ddp", "fp32", "none"), ("ddp", "fp32", "fp16"), ("ddp", "bf16", "none"), ("ddp", "bf16", "fp16"),
          ("ddp", "fp16", "none"), ("ddp", "fp16", "fp16"), ("fsdp", "fp32", "none"), ("fsdp", "bf16", "none")]


def torchrun(nproc: int, sets: dict) -> str:
    cmd = torchrun_command([a for k, v in sets.items() for a in ("--set", f"{k}={v}")], nproc_per_node=nproc,
                           master_port=free_port())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("MLFLOW_RUN_ID", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", help="also write the results as JSON here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    data = tmp / "markov"
    subprocess.run([sys.executable, "-m", "training", "make-data", "--kind", "markov", "--out", str(data),
                    "--train-rows", "4000", "--val-rows", "100"], check=True, capture_output=True, cwd=ROOT)
    base = {"dataset_uri": data, "model": "transformer", "hidden": 128, "depth": 4, "n_heads": 4, "steps": a.steps,
            "batch_size": 32, "log_every": 10, "checkpoint_every": 0}
    results = []
    print(f"{'world':>5} {'strategy':>8} {'precision':>9} {'hook':>5} {'samples/s':>10} {'vs ddp/fp32':>11}")
    for world in a.worlds:
        ref = None
        for strategy, prec, hook in COMBOS:
            if strategy == "ddp" and hook == "bf16":
                continue
            sets = {**base, "strategy": strategy, "precision": prec, "comm_hook": hook,
                    "checkpoint_dir": tmp / f"ck-{world}-{strategy}-{prec}-{hook}"}
            rates = [float(x) for x in re.findall(r"\| (\d+) samples/s", torchrun(world, sets))][1:]
            rate = statistics.mean(rates)
            ref = ref or rate
            results.append({"world": world, "strategy": strategy, "precision": prec, "comm_hook": hook, "samples_per_s": rate})
            print(f"{world:>5} {strategy:>8} {prec:>9} {hook:>5} {rate:>10.0f} {rate / ref:>11.2f}", flush=True)

    print("\ncheckpoint blocking time, 2 ranks, transformer, a save every 10 steps:")
    blocked = {}
    for mode in ("sync", "async"):
        sets = {**base, "strategy": "ddp", "checkpoint_every": 10, "async_checkpoint": str(mode == "async").lower(),
                "checkpoint_dir": tmp / f"ck-save-{mode}"}
        times = [float(x) for x in re.findall(r"training blocked ([0-9.]+)s", torchrun(2, sets))]
        blocked[mode] = statistics.median(times)
        print(f"  {mode:>5}: median {1000 * blocked[mode]:.1f} ms over {len(times)} saves")
    print(f"  async / sync = {blocked['async'] / blocked['sync']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"throughput": results, "ckpt_blocking_s": blocked}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
