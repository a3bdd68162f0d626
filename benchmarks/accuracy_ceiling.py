"""How far the demo's data lets a model go: eval accuracy of the trainer's recipe at several widths,
learning rates, batches and lengths, and of the teacher's own architecture fitted to convergence.

    .venv/bin/python benchmarks/accuracy_ceiling.py [--rows 20000]

The data is ``make-data --kind teacher`` (what ``make demo`` makes; ``--rows`` changes only the
training rows). The recipe is the trainer's, in one process: AdamW, linear warm-up then cosine
decay (``training.train.lr_lambda``), gradient clipping at 1.0, the trainer's sampler and seed;
eval accuracy on the validation split. The last line fits a tanh network of the teacher's shape
(16 -> 32 -> 4, no biases) with full-batch L-BFGS from two seeds: what the data allows a model
that could represent the teacher exactly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRID = [  # hidden, depth, lr, global batch, steps
    (128, 2, 3e-3, 64, 300), (256, 2, 2e-2, 512, 300), (256, 3, 2e-2, 256, 300), (64, 1, 1e-2, 256, 2000),
    (256, 2, 3e-3, 256, 3000), (256, 2, 1e-2, 1024, 2000),
]


def recipe_accuracy(x, y, xv, yv, hidden: int, depth: int, lr: float, batch: int, steps: int) -> list[tuple[int, float]]:
    import torch

    from training.config.train_config import TrainConfig
    from training.data.sampler import ShardedSampler
    from training.models.builtin import MLP
    from training.train import lr_lambda

    torch.manual_seed(1234)
    model = MLP(in_features=x.shape[1], n_classes=int(y.max()) + 1, hidden=hidden, depth=depth)
    cfg = TrainConfig(dataset_uri="-", steps=steps, lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    sampler = ShardedSampler(len(x), global_batch=batch, rank=0, world_size=1, seed=cfg.seed)
    curve = []
    for step in range(1, steps + 1):
        idx = torch.from_numpy(sampler.next_indices())
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        if step % max(1, steps // 6) == 0 or step == steps:
            with torch.no_grad():
                curve.append((step, float((model(xv).argmax(1) == yv).float().mean())))
    return curve


def teacher_shape_accuracy(x, y, xv, yv, seed: int) -> float:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 32, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(32, int(y.max()) + 1, bias=False))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=500, history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
    with torch.no_grad():
        return float((model(xv).argmax(1) == yv).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000, help="training rows of the teacher data")
    a = ap.parse_args()
    import torch

    from training.data.dataset import load_split

    data = Path(tempfile.mkdtemp(prefix="accuracy-ceiling-")) / "teacher"
    subprocess.run([sys.executable, "-m", "training", "make-data", "--out", str(data), "--train-rows", str(a.rows)],
                   check=True, capture_output=True, cwd=ROOT)
    train, val = load_split(data, "train"), load_split(data, "validation")
    x, y = torch.from_numpy(train.features), torch.from_numpy(train.labels)
    xv, yv = torch.from_numpy(val.features), torch.from_numpy(val.labels)
    print(f"teacher data, {a.rows} training rows (Bayes accuracy 0.925)")
    for hidden, depth, lr, batch, steps in GRID:
        curve = recipe_accuracy(x, y, xv, yv, hidden, depth, lr, batch, steps)
        print(f"  mlp {hidden} x {depth}, lr {lr:g}, batch {batch}, {steps} steps: final {curve[-1][1]:.4f}, "
              f"best {max(acc for _, acc in curve):.4f}  ({' '.join(f'{s}:{acc:.3f}' for s, acc in curve)})", flush=True)
    shaped = [teacher_shape_accuracy(x, y, xv, yv, seed) for seed in (0, 1)]
    print(f"  the teacher's shape (tanh 32 x 1), full-batch L-BFGS, seeds 0 and 1: "
          f"{' '.join(f'{acc:.4f}' for acc in shaped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
