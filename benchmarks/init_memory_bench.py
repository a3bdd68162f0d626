"""Each rank's peak resident memory while the built-in decoder is built and sharded with FSDP2 on
2 ranks (torchrun, gloo), the old way (the whole model built on every rank, then ``fully_shard``)
against the new (built on the meta device, sharded, each rank filling only its shards:
training/models/materialize.py), each in fresh processes; glibc set to return large frees as a
rank does (``training.metrics.memory.tame_malloc``). The new way then trains two AdamW steps and
exports, as a run does, and prints those peaks too.

    .venv/bin/python scripts/project_env.py .venv/bin/python benchmarks/init_memory_bench.py [--hidden 1024] [--depth 12]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK = """
import json, os, sys
from training.config.train_config import TrainConfig
from training.metrics.memory import tame_malloc
tame_malloc()
def hwm():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) << 10
from training.distributed import parallel
from training.models.build import build_for_training, build_model
from training.models.spec import ModelSpec
way, hidden, depth, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
meta = {"kind": "tokens", "task": "language_modeling", "features": ["t"], "vocab_size": 256, "seq_len": 64}
spec = ModelSpec.for_data("transformer", meta, hidden=hidden, depth=depth, n_heads=8)
info = parallel.init(600)
base = hwm()
cfg = TrainConfig(dataset_uri="unused", strategy="fsdp", precision="fp32")
if way == "whole":
    model, _ = parallel.parallelize(build_model(spec), cfg, info)
else:
    model, initial = build_for_training(spec, seed=0, strategy="fsdp")
    model, _ = parallel.parallelize(model, cfg, info, initial)
params = sum(p.numel() for p in model.parameters())
local = sum(p.to_local().numel() * 4 for p in model.parameters())
largest = max(p.numel() * 4 for p in model.parameters())
built = hwm()
if way == "sharded":  # then train as the trainer does (2 AdamW steps) and export: the whole run's peaks
    import tempfile, torch
    from training.checkpoint.export import export_model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randint(0, 256, (1, 16))).float().mean().backward()
        opt.step()
    trained = hwm()
    opt.zero_grad(set_to_none=True)
    export_model(model, tempfile.mkdtemp(), spec)
    exported = hwm()
json.dump({"rank": info.rank, "baseline": base, "peak": built, "params": params, "local_bytes": local,
           "largest_param_bytes": largest, **({"trained": trained, "exported": exported} if way == "sharded" else {})},
          open(f"{out}.{info.rank}", "w"))
parallel.cleanup()
"""


def measure(way: str, hidden: int, depth: int, port: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "rank.py", Path(tmp) / "peak"
        script.write_text(RANK)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(script), way, str(hidden), str(depth), str(out)]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=12)
    a = ap.parse_args()
    from training.util import free_port

    mib = 1 << 20
    for way in ("whole", "sharded"):
        ranks = measure(way, a.hidden, a.depth, free_port())
        r0 = ranks[0]
        if way == "whole":
            print(f"decoder {r0['params'] / 1e6:.0f}M parameters (hidden {a.hidden}, depth {a.depth}): "
                  f"{r0['params'] * 4 / mib:.0f} MiB in fp32, {r0['local_bytes'] / mib:.0f} MiB per rank's shards, "
                  f"largest parameter {r0['largest_param_bytes'] / mib:.0f} MiB  [load {os.getloadavg()[0]:.2f}]")
        peaks = ", ".join(f"rank {r['rank']} {r['peak'] / mib:.0f} MiB (+{(r['peak'] - r['baseline']) / mib:.0f} over "
                          f"{r['baseline'] / mib:.0f} after imports)" for r in ranks)
        print(f"{way:>8}: peak while building and sharding: {peaks}")
    print("then 2 AdamW steps (batch 1 x 16 tokens): " + ", ".join(f"rank {r['rank']} {r['trained'] / mib:.0f} MiB"
                                                                for r in ranks)
          + "; then the export (the whole model gathered on rank 0): "
          + ", ".join(f"rank {r['rank']} {r['exported'] / mib:.0f} MiB" for r in ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
