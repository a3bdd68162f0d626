"""What activation checkpointing saves and costs on the built-in decoder, in one process: the bytes
autograd keeps for backward in one forward (``training.models.activations.saved_bytes``: parameters
not counted, each storage once; a recomputed block's inputs counted) and the time of a training
step (forward, backward, AdamW), for none / full / selective, timed in alternating rounds.

    .venv/bin/python benchmarks/memory_bench.py [--hidden 256] [--depth 8] [--seq-len 256] [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("none", "selective", "full")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and mode (after one untimed)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import torch

    from training.models import activations
    from training.models.builtin import Transformer

    def make(mode: str):
        torch.manual_seed(0)
        model = Transformer(vocab_size=a.vocab, seq_len=a.seq_len, d_model=a.hidden, n_layers=a.depth, n_heads=a.heads,
                            dropout=a.dropout).train()
        activations.apply(model, mode)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    x = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(1))
    models = {m: make(m) for m in MODES}
    n_params = sum(p.numel() for p in models["none"][0].parameters())
    print(f"decoder {n_params / 1e6:.1f}M parameters (hidden {a.hidden}, depth {a.depth}), batch {a.batch} x seq_len "
          f"{a.seq_len}, dropout {a.dropout}, {torch.get_num_threads()} threads  [load {os.getloadavg()[0]:.2f}]")
    saved = {m: activations.saved_bytes(models[m][0], x[:, :-1]) for m in MODES}

    def step(mode: str) -> None:
        model, opt = models[mode]
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.repeats):
        for mode in MODES:
            step(mode)  # untimed: allocations, first-call costs
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(mode)
            times[mode].append((time.perf_counter() - t0) / a.steps)
        print(f"  round {r + 1}: " + " | ".join(f"{m} {times[m][-1] * 1e3:7.0f} ms/step" for m in MODES)
              + f"  [load {os.getloadavg()[0]:.2f}]", flush=True)
    base = statistics.median(times["none"])
    for mode in MODES:
        t = statistics.median(times[mode])
        print(f"{mode:>9}: kept for backward {saved[mode] / 2**20:8.1f} MiB ({saved[mode] / saved['none']:.2f}x of none), "
              f"step {t * 1e3:7.0f} ms ({t / base:.2f}x of none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
