"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) and a portable final export.

Layout of the local checkpoint folder::

    {checkpoint_dir}/step_00000100/         DCP shards (__N_0.distcp) + .metadata
    {checkpoint_dir}/step_00000100/rng_rankN.pt   each rank's RNG states (tensors and ints only)
    {checkpoint_dir}/step_00000100/COMPLETE  written by rank 0 after every rank finished (JSON)
    {checkpoint_dir}/step_00000300/model.safetensors + model_config.json   (final step only)

A folder without ``COMPLETE`` is an interrupted save and is never resumed from.

``Checkpointer`` owns when to save as well as how: ``resume`` at start, ``maybe_save`` after every
step (every ``checkpoint_every`` steps), ``finalize`` at the end (the final step with the exported
model), ``save(final=True)`` on preemption.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # private, but the planner's own helper
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from training.log import logger
from training.tracking import NullLogger
from training.util import atomic_write

STEP_DIR_RE = re.compile(r"^step_(\d{8})$")
COMPLETE = "COMPLETE"
MODEL_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor values (optimizer hyper-parameters, counters) as pickled bytes and
    its default planner loads them with ``weights_only=False``. A checkpoint is input from
    storage, so we refuse arbitrary objects: only tensors and plain containers load."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class TrainState(Stateful):
    """Everything a resume needs, as DCP sees it: model, optimizer, LR scheduler, grad scaler,
    sampler position and step. (Per-rank RNG states are kept beside it, see save_rng.)"""

    def __init__(self, model, optimizer, scheduler, sampler, scaler=None):
        self.model, self.optimizer, self.scheduler, self.sampler, self.scaler = model, optimizer, scheduler, sampler, scaler
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {
            "model": msd,
            "optim": osd,
            "scheduler": self.scheduler.state_dict(),
            "sampler_pos": torch.tensor(self.sampler.pos, dtype=torch.int64),
            "step": torch.tensor(self.step, dtype=torch.int64),
        }
        if self.scaler is not None and self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "scaler" in state and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.pos = int(state["sampler_pos"])
        self.step = int(state["step"])


def rng_state() -> dict[str, Any]:
    """Every RNG of this rank, in types ``torch.load(weights_only=True)`` accepts."""
    _, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves TrainState into ``{checkpoint_dir}/step_XXXXXXXX/`` (sync or async) and marks each
    folder COMPLETE only once every rank's data and DCP's metadata are written.

    Async saves run on their own gloo process group so that the background thread's collectives
    never interleave with the training collectives on the default group.

    Cadence: ``maybe_save`` saves every ``every`` steps before ``last_step`` (0: never), says how
    long training was blocked and logs ``ckpt/blocking_s`` through ``metrics``; ``finalize``
    writes ``last_step``'s checkpoint. ``phase`` (resilience.Phase) is told what is going on, so
    that a failed save is named in the error.
    """

    def __init__(self, checkpoint_dir: str | Path, *, world_size: int, config_hash: str, use_async: bool,
                 every: int = 0, last_step: int | None = None, metrics=None, phase=None):
        self.root = Path(checkpoint_dir)
        self.world_size, self.config_hash, self.use_async = world_size, config_hash, use_async
        self.every, self.last_step = every, last_step
        self.metrics = metrics if metrics is not None else NullLogger()
        self.phase = phase
        self.rank = dist.get_rank()
        self.pending: tuple[Any, Path, int] | None = None
        self.group = dist.new_group(backend="gloo") if use_async else None
        self.saved_step = -1  # the step of the newest checkpoint written or loaded

    def resume(self, state: TrainState) -> tuple[Path | None, bool]:
        """Load the latest complete checkpoint into ``state`` if there is one. Returns its folder
        (None: starting from scratch) and whether this rank's RNG state was restored (see load)."""
        path = latest_complete(self.root)
        if path is None:
            return None, False
        rng_restored = load(state, path)
        self.saved_step = state.step
        return path, rng_restored

    def maybe_save(self, state: TrainState, step: int) -> None:
        """After a step: mark a finished async save complete; every ``every`` steps (but not the
        last step, which ``finalize`` writes), save."""
        self.poll()
        if not self.every or step % self.every or (self.last_step is not None and step >= self.last_step):
            return
        if self.phase is not None:
            self.phase.now = f"checkpoint save at step {step}"
        blocked = self.save(state)
        logger.info(f"checkpoint step {step}: training blocked {blocked:.4f}s ({'async' if self.use_async else 'sync'})")
        self.metrics.log_metrics({"ckpt/blocking_s": blocked}, step=step)
        self.saved_step = step

    def finalize(self, state: TrainState, model, spec: dict[str, Any]) -> Path:
        """Collective: the final checkpoint of ``state.step`` with the portable model, unless that
        step was saved already. Returns its folder."""
        self.wait()
        final_dir = self.root / step_dir_name(state.step)
        if self.saved_step != state.step:
            # Export the portable model before marking the folder COMPLETE, so a complete final
            # checkpoint always carries model.safetensors.
            export_model(model, final_dir, spec)
            self.save(state, final=True)
        return final_dir

    def save(self, state: TrainState, *, final: bool = False) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        path = self.root / step_dir_name(state.step)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), path / f"rng_rank{self.rank}.pt")
        if self.use_async and not final:
            future = dcp.async_save({"train": state}, checkpoint_id=str(path), process_group=self.group)
            self.pending = (future, path, state.step)
        else:
            dcp.save({"train": state}, checkpoint_id=str(path))
            self._mark_complete(path, state.step)
        return time.perf_counter() - t0

    def poll(self) -> None:
        """Mark a finished async save complete without waiting for an unfinished one."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, path, step = self.pending
        self.pending = None
        future.result()
        self._mark_complete(path, step)

    def _mark_complete(self, path: Path, step: int) -> None:
        # DCP's save (or the async future) returns on the coordinator (rank 0) only after every
        # rank's write results were gathered and the metadata file written.
        if self.rank == 0:
            marker = {"step": step, "world_size": self.world_size, "config_hash": self.config_hash}
            atomic_write(path / COMPLETE, json.dumps(marker) + "\n")


def latest_complete(checkpoint_dir: str | Path) -> Path | None:
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if STEP_DIR_RE.match(p.name) and (p / COMPLETE).is_file()]
    return max(done, key=lambda p: p.name, default=None)


def load(state: TrainState, path: str | Path) -> bool:
    """Load ``path`` into ``state``; returns whether this rank's RNG state was restored too (it is
    not when the checkpoint was written by fewer ranks than now run)."""
    dcp.load({"train": state}, checkpoint_id=str(path), planner=_WeightsOnlyLoadPlanner())
    rng_file = Path(path) / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
        return True
    return False


def export_model(model, path: str | Path, spec: dict[str, Any]) -> None:
    """Collective: consolidate the full model on rank 0 and write safetensors + its config."""
    from safetensors.torch import save_file

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / (MODEL_FILE + ".tmp")
        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp))
        os.replace(tmp, path / MODEL_FILE)
        atomic_write(path / MODEL_CONFIG_FILE, json.dumps(spec, indent=2) + "\n")
    dist.barrier()


def load_exported(path: str | Path):
    """Rebuild the model from ``model.safetensors`` + ``model_config.json`` (no pickle involved)."""
    from safetensors.torch import load_file

    from training.models import build_model

    path = Path(path)
    spec = json.loads((path / MODEL_CONFIG_FILE).read_text())
    model = build_model(spec)
    model.load_state_dict(load_file(str(path / MODEL_FILE)))
    return model, spec
