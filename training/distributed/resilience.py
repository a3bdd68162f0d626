"""Surviving failures, and failing clearly.

- ``Preemption``: on SIGTERM all ranks agree on a step, write one checkpoint of it and stop
  (``Preempted``, exit code 75); running the same command again resumes.
- ``ReplicaCheck``: data-parallel replicas must stay bit-identical; checked every ``replica_check_every`` steps.
- ``Phase``: what this rank is doing right now, so that a failure (a collective timeout says only
  "timed out") names the rank, the operation and the step.
- ``RankRecord``: each rank's heartbeat (its last completed step, in a memory-mapped file that
  survives a SIGKILL) and, when it fails, what it was doing; the launcher reads them to say which
  rank died or hung and which collective its peers were waiting in.

What a restart cost: ``FaultReport`` (training/metrics/recorder.py); faults for tests and drills:
training/distributed/faults.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import signal
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from training.distributed.parallel import DistInfo, full_tensor
from training.log import logger
from training.util import atomic_write



class Preempted(Exception):
    """SIGTERM: a checkpoint of the step in ``args[0]`` was written; run again to resume."""


class RankRecord:
    """``<output_dir>/ranks/``: per rank a heartbeat and, on failure, a record of what failed.

    The heartbeat is 16 bytes (last completed step, its wall time) in a memory-mapped file: writing
    it is a memory store, no system call, so it can run every step; the page cache keeps it when the
    process is SIGKILLed. ``rank{R}.json`` is written by a rank that raised (phase, step, error).
    A rank with a heartbeat and no record died by a signal or hung; ``read`` gives the launcher both.
    """

    BEAT = struct.Struct("<qd")

    def __init__(self, output_dir: Path | None, rank: int) -> None:
        self.rank, self._map = rank, None
        self.folder = output_dir / "ranks" if output_dir else None
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{rank}.json").unlink(missing_ok=True)  # a record of an earlier attempt
        path = self.folder / f"rank{rank}.beat"
        if not path.exists() or path.stat().st_size != self.BEAT.size:  # else: an earlier attempt's last step
            with open(path, "wb") as f:
                f.write(self.BEAT.pack(-1, time.time()))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), self.BEAT.size)

    def beat(self, step: int) -> None:
        if self._map is not None:
            self.BEAT.pack_into(self._map, 0, step, time.time())

    def failed(self, phase: str, step: int, error: BaseException, cause: str = "") -> None:
        """Record the failure; ``cause``: what the error means, when the trainer knows (a timeout)."""
        if self.folder is not None:
            first = next((l for l in str(error).splitlines() if l.strip()), type(error).__name__)
            said = f"{cause}: " if cause else ""
            atomic_write(self.folder / f"rank{self.rank}.json", json.dumps(
                {"rank": self.rank, "phase": phase, "step": step, "error": f"{said}{type(error).__name__}: {first}"[:500],
                 "time": time.time()}) + "\n")

    @classmethod
    def read(cls, output_dir: Path) -> list[dict[str, Any]]:
        """Every rank's last completed step and failure record (None where it raised nothing)."""
        folder = Path(output_dir) / "ranks"
        out = []
        for beat in sorted(folder.glob("rank*.beat"), key=lambda p: int(p.stem[4:])):
            step, t = cls.BEAT.unpack(beat.read_bytes()[: cls.BEAT.size])
            record = folder / f"{beat.stem}.json"
            out.append({"rank": int(beat.stem[4:]), "last_step": step, "beat_time": t,
                        "failure": json.loads(record.read_text()) if record.exists() else None})
        return out


class Phase:
    """What this rank is doing now, named by the components around work that can fail or hang:
    ``with phase("evaluation"): ...``. Leaving a phase returns to the enclosing one; a failure inside
    leaves it named, so ``names_failures`` says where the rank was (a timeout alone says only "timed out")."""

    # gloo: "Timed out waiting 5000ms for recv ...", "Application timeout caused pair closure";
    # NCCL: "Watchdog caught collective operation timeout".
    TIMEOUT = re.compile(r"time[d ]?\s?out", re.IGNORECASE)

    def __init__(self, record: RankRecord | None = None, collective_timeout_s: float | None = None) -> None:
        self.now = "setup"
        self.record = record
        self.collective_timeout_s = collective_timeout_s
        self._outer: list[str] = []

    def __call__(self, name: str) -> "Phase":
        self._outer.append(self.now)
        self.now = name
        return self

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        outer = self._outer.pop()
        if exc_type is None:  # a failure keeps its phase named for the error
            self.now = outer

    @contextlib.contextmanager
    def names_failures(self, info: DistInfo, step: Callable[[], int]):
        """Re-raise a failure inside as ``rank R/W: PHASE failed at step S: ...`` (and record it);
        a collective that timed out is named as such, with what to do."""
        try:
            yield
        except Preempted:
            raise
        except Exception as e:
            cause = (f"a collective timed out after collective_timeout_s={self.collective_timeout_s:g}s"
                     if self.collective_timeout_s and self.TIMEOUT.search(str(e)) else "")
            if self.record is not None:
                self.record.failed(self.now, step(), e, cause)
            said = (f"{cause} (another rank stopped responding: read the other ranks' logs; if a step legitimately "
                    "takes that long, raise collective_timeout_s): ") if cause else ""
            raise RuntimeError(f"rank {info.rank}/{info.world_size}: {self.now} failed at step {step()}: {said}{e}") from e


class Preemption:
    """SIGTERM sets a flag; all ranks agree on it at step boundaries (a MAX all-reduce of one
    int), so every rank stops after the same step and they write one consistent checkpoint.

    Even a one-int all-reduce is a round trip that makes every step wait for the slowest rank, a
    visible share of a small model's step (docs/benchmarks.md, "Trainer overhead"). So the check
    runs every ``every`` steps, ``every`` chosen at each log window from the slowest rank's step
    time so that checks are about ``INTERVAL_S`` apart (every step for slow steps, at most
    ``log_every`` apart); and the all-reduce is launched asynchronously at one check and read at
    the next, behind compute.
    A SIGTERM thus stops training at most two intervals plus one step after it arrives, far
    inside the grace period. All ranks compute the same ``every`` from the same all-reduced step
    time, so they always check at the same steps.
    """

    INTERVAL_S = 0.2

    def __init__(self, grace_s: float, *, log_every: int, device: torch.device, checkpointer, phase: Phase) -> None:
        self.grace_s, self.log_every, self.device = grace_s, log_every, device
        self.checkpointer, self.phase = checkpointer, phase
        self.requested = False
        self.every = 1  # until a step time is known
        self._pending: tuple[torch.Tensor, Any] | None = None

    def arm(self) -> None:
        """From now on SIGTERM asks for the agreed stop."""
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.requested:  # a second SIGTERM: stop now
            os._exit(128 + signal.SIGTERM)
        self.requested = True
        # A rank stuck in a collective never reaches the step boundary; torchrun's teardown of a
        # failed group also arrives as SIGTERM. Don't outlive the grace period either way.
        timer = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
        timer.daemon = True
        timer.start()

    def pace(self, window: dict[str, float]) -> None:
        """Space the checks by the slowest rank's step time of the window just closed
        (``perf/step_s``, the same all-reduced value on every rank)."""
        self.every = max(1, min(self.log_every, int(self.INTERVAL_S / max(window["perf/step_s"], 1e-9))))

    def maybe_stop(self, state) -> None:
        """Before a step: once every rank knows of a SIGTERM, checkpoint this step and raise Preempted."""
        with self.phase("preemption check"):
            if state.step % self.every or not self._agreed():
                return
            self.drain()
            self.checkpointer.save(state, final=True)
            raise Preempted(state.step)

    def _agreed(self) -> bool:
        """True on every rank, at the same check, once any rank got SIGTERM before the previous check."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=self.device)
        previous, self._pending = self._pending, (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        if previous is None:
            return False
        result, work = previous
        work.wait()
        return bool(result.item())

    def drain(self) -> None:
        """Complete the last in-flight agreement (before other collectives or teardown)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None


class ReplicaCheck:
    """Fail loudly if data-parallel replicas drifted apart (they must stay bit-identical): every
    ``every`` steps (0: never) all ranks hash their weights and compare."""

    def __init__(self, model: torch.nn.Module, info: DistInfo, every: int, phase: Phase) -> None:
        self.model, self.info, self.every, self.phase = model, info, every, phase

    def maybe_check(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        with self.phase("replica check"):
            digest = weights_digest(self.model)
            digests: list[Any] = [None] * self.info.world_size
            dist.all_gather_object(digests, digest)
            if len(set(digests)) != 1:
                raise RuntimeError(f"replica check at step {step}: weights differ across ranks: {digests}")
        logger.info(f"replica check step {step}: identical on {self.info.world_size} ranks sha256={digest[:16]}")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every weight's name and bytes (sharded weights gathered whole: a collective)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(full_tensor(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
