"""Pure formulas behind the figures the trainer logs: training FLOPs, goodput from the step
records of every attempt, bus bandwidth, whether a target was reached. No torch, no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from training.config.train_config import higher_is_better


def flops_per_sample(spec: Any, n_params: int, trainable: int | None = None) -> float:
    """Training FLOPs per sample (forward + backward = 3x forward), the usual 6*N*tokens rule for the
    transformer plus attention (12 * layers * seq * d per token), 6*N for the dense models
    (the CNN's conv FLOPs are counted from its output map size). A user's model is counted by the
    parameter rule (per token for tokens): exact for dense layers, an undercount for convolutions.
    ``trainable``: with a frozen base (an adapter) backward computes the activations' gradients
    through every weight but weight gradients for the trained ones only: 4*N + 2*trainable."""
    if spec.model == "transformer":
        t = spec.seq_len
        return 6.0 * n_params * t + 12.0 * spec.arch["n_layers"] * t * t * spec.arch["d_model"]
    if spec.model == "cnn":
        c, h, w = spec.image_shape
        conv = 2 * (h * w * 32 * c * 9) + 2 * (h * w * 64 * 32 * 9)
        return 3.0 * conv + 6.0 * n_params
    per_param = 6.0 * n_params if trainable is None else 4.0 * n_params + 2.0 * trainable
    if spec.kind in ("tokens", "text"):  # another model over tokens: the parameter rule per token
        return per_param * spec.seq_len
    return 6.0 * n_params


def target_reached(metric: str, value: float, target: float) -> bool:
    """Accuracy and R² must reach the target from below, a loss or an RMSE from above."""
    return value >= target if higher_is_better(metric) else value <= target


def lineage_summary(records: Iterable[dict[str, Any]], *, start: float, end: float,
                    world_size: int = 1) -> dict[str, float]:
    """Goodput and restart losses from the per-step records of every attempt (``steps.jsonl``).

    The lineage is the last record of each step (the one the final model descends from). Between
    two consecutive lineage steps written by different attempts lies a restart: the gap from the
    end of the earlier step to the end of the later one, minus the later step's own time, was lost
    (steps done again, the dead time, the restart, the checkpoint load).

    Device-seconds charge each attempt its own world size (``world`` in its records, else
    ``world_size``): an elastic run that went on with fewer ranks used fewer devices. The wall
    time is cut at each attempt's last record; a restart's dead time goes to the attempt after it.

    ``records`` is read once, as a stream: the lineage is kept in arrays indexed by step (about 20
    bytes a step), not as a million parsed records at the end of a long run."""
    import numpy as np

    size = 1024
    t, step_s = np.zeros(size), np.zeros(size)
    attempt, world = np.full(size, -1, dtype=np.int32), np.zeros(size, dtype=np.int32)
    attempts: dict[Any, int] = {}
    ends: dict[Any, tuple[float, int]] = {}  # attempt -> (its last record's time, its world size), in order
    for rec in records:
        if "step_s" not in rec:
            continue
        k = int(rec["step"])
        if k >= size:
            grow = max(k + 1, 2 * size) - size
            t, step_s = np.concatenate([t, np.zeros(grow)]), np.concatenate([step_s, np.zeros(grow)])
            attempt = np.concatenate([attempt, np.full(grow, -1, dtype=np.int32)])
            world = np.concatenate([world, np.zeros(grow, dtype=np.int32)])
            size += grow
        key = rec.get("attempt")
        w = int(rec.get("world", world_size))
        t[k], step_s[k], attempt[k], world[k] = rec["t"], rec["step_s"], attempts.setdefault(key, len(attempts)), w
        ends[key] = (rec["t"], w)
    present = np.flatnonzero(attempt >= 0)
    productive = float(step_s[present].sum())
    a, b = present[:-1], present[1:]
    switch = attempt[a] != attempt[b]
    gaps = np.maximum(0.0, t[b] - t[a] - step_s[b])[switch]
    lost, lost_device = float(gaps.sum()), float((gaps * world[b][switch]).sum())
    device, since = 0.0, start
    for i, (t_end, w) in enumerate(ends.values()):
        until = end if i == len(ends) - 1 else t_end
        device += max(0.0, until - since) * w
        since = until
    wall = max(end - start, 1e-9)
    return {"productive_s": productive, "lost_to_restarts_s": lost, "wall_s": wall, "goodput": productive / wall,
            "device_s": device if ends else wall * world_size, "lost_device_s": lost_device}


def bits_per_byte(loss_nats: float, tokens_per_byte: float | None) -> float | None:
    """A language model's loss (nats per token) as bits per UTF-8 byte of the text it scored: the
    figure that stays comparable across tokenizers. None without the text's size."""
    return loss_nats / math.log(2) * tokens_per_byte if tokens_per_byte else None
