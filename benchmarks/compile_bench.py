"""What ``compile=blocks`` costs and gains on the built-in decoder, in one process: the seconds spent
compiling (torch's own counter, forward and backward of the first step) and the steady step time
(forward, backward, AdamW) against the eager model's, timed in alternating rounds. The model is
compiled by the trainer's own ``training.models.compiling.apply``, after activation checkpointing
when ``--ac full``. The inductor cache is a fresh folder, so the compile time is a cold start's.

    .venv/bin/python benchmarks/compile_bench.py [--hidden 256] [--depth 4] [--seq-len 128] [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ac", choices=["none", "full"], default="none", help="activation checkpointing")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and mode (after one untimed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when there is one")
    a = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

    import torch

    from training.models import activations, compiling
    from training.models.builtin import Transformer

    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")

    def make(mode: str):
        torch.manual_seed(0)
        model = Transformer(vocab_size=a.vocab, seq_len=a.seq_len, d_model=a.hidden, n_layers=a.depth,
                            n_heads=a.heads, dropout=0.0).to(device).train()
        activations.apply(model, a.ac)
        compiling.apply(model, mode)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    x = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(1)).to(device)
    models = {m: make(m) for m in compiling.MODES}
    n_params = sum(p.numel() for p in models["none"][0].parameters())
    print(f"decoder {n_params / 1e6:.1f}M parameters (hidden {a.hidden}, depth {a.depth}), batch {a.batch} x seq_len "
          f"{a.seq_len}, activation checkpointing {a.ac}, {device}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}  [load {os.getloadavg()[0]:.2f}]", flush=True)

    def step(mode: str) -> None:
        model, opt = models[mode]
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    step("blocks")
    first = time.perf_counter() - t0
    compile_s = compiling.compile_seconds()
    print(f"first compiled step {first:.1f} s, of which compiling {compile_s:.1f} s  [load {os.getloadavg()[0]:.2f}]",
          flush=True)
    times: dict[str, list[float]] = {m: [] for m in compiling.MODES}
    for r in range(a.repeats):
        for mode in compiling.MODES:
            step(mode)  # untimed
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(mode)
            times[mode].append((time.perf_counter() - t0) / a.steps)
        print(f"  round {r + 1}: " + " | ".join(f"{m} {times[m][-1] * 1e3:7.1f} ms/step" for m in compiling.MODES)
              + f"  [load {os.getloadavg()[0]:.2f}]", flush=True)
    eager, compiled = statistics.median(times["none"]), statistics.median(times["blocks"])
    print(f"eager {eager * 1e3:.1f} ms/step, compile=blocks {compiled * 1e3:.1f} ms/step: speed ratio "
          f"{eager / compiled:.2f}x (above 1: compiled is faster); compiling took {compile_s:.1f} s, repaid after "
          f"{compile_s / max(eager - compiled, 1e-9):.0f} steps" if compiled < eager else
          f"eager {eager * 1e3:.1f} ms/step, compile=blocks {compiled * 1e3:.1f} ms/step: speed ratio "
          f"{eager / compiled:.2f}x (not faster here); compiling took {compile_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
