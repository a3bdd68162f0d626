"""What the trainer keeps per step and per run: rank 0's step records (``steps.jsonl``), a step's
result, a log window's sums, the ETA, and ``RunClock`` (facts that survive restarts)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.distributed.comm import CommStep
from training.util import atomic_write


class RunClock:
    """Facts that must survive restarts and retries of the same run, in ``<dir>/run_clock.json``
    (rank 0 only): when the run's first attempt started training, and when the target was hit."""

    def __init__(self, folder: Path | None) -> None:
        self.path = folder / "run_clock.json" if folder else None
        self.data: dict[str, Any] = {}
        if self.path is not None and self.path.exists():
            self.data = json.loads(self.path.read_text())
        self.data.setdefault("start", time.time())
        self._save()

    @property
    def start(self) -> float:
        return float(self.data["start"])

    def _save(self) -> None:
        if self.path is not None:
            atomic_write(self.path, json.dumps(self.data))

    def target(self) -> dict[str, float] | None:
        return self.data.get("target")

    def reach_target(self, step: int, now: float) -> dict[str, float]:
        self.data["target"] = {"steps_to_target": float(step), "time_to_target_s": now - self.start}
        self._save()
        return self.data["target"]


class EtaSmoother:
    """Seconds per step, wall clock (evaluation and checkpoints included: they are part of what is
    left), smoothed over log windows: an exponential moving average, seeded by the warm-up window
    and replaced by the first steady one, so one slow window (a checkpoint, an evaluation) moves
    the ETA by a fraction of its excess instead of multiplying it."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.per_step: float | None = None
        self._seeded_by_warmup = False

    def update(self, steps: int, seconds: float, *, first: bool = False) -> float:
        current = seconds / max(1, steps)
        if self.per_step is None or self._seeded_by_warmup:
            self.per_step, self._seeded_by_warmup = current, first
        else:
            self.per_step += self.weight * (current - self.per_step)
        return self.per_step


class StepLog:
    """Rank 0's per-step records, ``<output_dir>/steps.jsonl``, one JSON line per step across
    every attempt of a run.

    The file is opened once and flushed after every step: one write to the page cache, no
    rename or fsync, so it costs microseconds and a killed attempt still leaves each step it
    completed on disk. On CUDA a step's loss is read one step later, when the GPU has long
    finished it, so that recording never makes the CPU wait for the GPU."""

    NAME = "steps.jsonl"

    def __init__(self, folder: Path, lag: int = 0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / self.NAME, "a", encoding="utf-8")
        self._lag = lag
        self._pending: list[tuple[dict[str, Any], torch.Tensor]] = []

    def add(self, record: dict[str, Any], loss: torch.Tensor) -> None:
        self._pending.append((record, loss))
        while len(self._pending) > self._lag:
            self._write(*self._pending.pop(0))
        self._file.flush()

    def _write(self, record: dict[str, Any], loss: torch.Tensor) -> None:
        self._file.write(json.dumps({**record, "loss": float(loss).hex()}) + "\n")

    def close(self) -> None:
        for pending in self._pending:
            self._write(*pending)
        self._pending = []
        self._file.close()

    @classmethod
    def iter(cls, folder: Path) -> Iterator[dict[str, Any]]:
        """Every record, one line at a time (a long run has millions)."""
        path = folder / cls.NAME
        if not path.exists():
            return
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash mid-write
                    continue

    @classmethod
    def read(cls, folder: Path) -> list[dict[str, Any]]:
        return list(cls.iter(folder))

    @classmethod
    def last(cls, folder: Path) -> dict[str, Any] | None:
        """The last complete record, read from the end of the file."""
        path = folder / cls.NAME
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 65536))
                tail = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None
        for line in reversed(tail.splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:  # cut short by a crash, or the first, partial line of the tail
                continue
        return None


@dataclass
class StepResult:
    """What one training step hands to the metrics recorder."""

    loss: torch.Tensor  # the step's loss (mean over the global batch share), on the device
    grad_norm: torch.Tensor | None  # when clipping measured it; else measured at log steps
    skipped: bool  # fp16: the grad scaler skipped the step (inf/nan gradients)
    seconds: float  # wall time of the step on this rank
    data_s: float  # of which waiting for the batch
    exposed: Any  # CommTimer.backward_done() of the communicating backward: seconds, CUDA events or None
    comm: CommStep  # the step's collectives


@dataclass
class Window:
    """Sums over the steps of one log window (contiguous: logging one counts in the next)."""

    t0: float
    loss: torch.Tensor
    t_end: float = 0.0  # set when the window closes
    steps: int = 0
    data_s: float = 0.0
    not_training_s: float = 0.0  # evaluation: not counted as training time
    comm_s: float = 0.0
    exposed: list[Any] = field(default_factory=list)
    comm: CommStep | None = None  # the last step's (bytes, collectives: the same every step)
    dim_s: dict[str, float] = field(default_factory=dict)  # seconds per mesh dimension, this rank's

    def add(self, r: StepResult) -> None:
        self.steps += 1
        self.loss += r.loss
        self.data_s += r.data_s
        if r.exposed is not None:
            self.exposed.append(r.exposed)
        if r.comm.blocked_s:  # synchronous collectives (FSDP on gloo): all of their time was exposed
            self.exposed.append(r.comm.blocked_s)
        self.comm_s += r.comm.seconds
        self.comm = r.comm
        for dim, seconds in r.comm.by_dim.items():
            self.dim_s[dim] = self.dim_s.get(dim, 0.0) + seconds
