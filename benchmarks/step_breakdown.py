"""Where a step of the demo's configuration goes: the local arithmetic of one rank and the
gradient all-reduce between two, timed apart (what benchmarks/overhead_bench.py measures
together).

    .venv/bin/python benchmarks/step_breakdown.py

Part 1, one process, one thread (as each of 2 ranks on 2 cores): the trainer's default MLP on a
per-rank batch (32 of the global 64), forward + backward, `clip_grad_norm_`, the fused AdamW step,
the LR schedule; microseconds per call, median of 5 blocks. Part 2, 2 gloo ranks under torchrun on
loopback: one `all_reduce` of the model's gradient size, and of 1,000 and 100,000 floats, per
call, timed on rank 0.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _per_call_us(fn, calls: int = 2000, blocks: int = 5) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def local_parts() -> int:
    import torch

    from training.config.train_config import TrainConfig
    from training.models.builtin import MLP

    torch.set_num_threads(1)
    cfg = TrainConfig(dataset_uri="-")
    model = MLP(in_features=16, n_classes=4, hidden=cfg.hidden, depth=cfg.depth)
    x, y = torch.randn(cfg.batch_size // 2, 16), torch.randint(0, 4, (cfg.batch_size // 2,))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    def forward_backward():
        torch.nn.functional.cross_entropy(model(x), y).backward()

    forward_backward()
    parts = {"forward + backward": forward_backward,
             "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip),
             "fused AdamW step": opt.step, "LR schedule step": sched.step}
    n = sum(p.numel() for p in model.parameters())
    print(f"one rank's arithmetic: MLP {cfg.hidden} x {cfg.depth} ({n:,} parameters), batch {cfg.batch_size // 2}, "
          f"1 thread")
    total = 0.0
    for name, fn in parts.items():
        us = _per_call_us(fn)
        total += us
        print(f"  {name:<20} {us:7.1f} us")
    print(f"  {'sum':<20} {total:7.1f} us")
    return n


def all_reduce_worker(sizes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for n in sizes:
        t = torch.randn(n)
        us = _per_call_us(lambda: dist.all_reduce(t), calls=1000)
        if dist.get_rank() == 0:
            print(f"  all_reduce of {n:>7,} floats {us:7.1f} us", flush=True)
    dist.barrier()
    os._exit(0)  # no process-group teardown: see training/distributed/parallel.py on gloo's destructor


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        all_reduce_worker([int(s) for s in sys.argv[2:]])
        return 0
    n = local_parts()
    print("between 2 gloo ranks on loopback (rank 0's time per call):", flush=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    from training.distributed.launch import torchrun_command
    from training.util import free_port

    cmd = torchrun_command(["--worker", str(n), "1000", "100000"], nproc_per_node=2, master_port=free_port(),
                           entry=[str(Path(__file__).resolve())])
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
