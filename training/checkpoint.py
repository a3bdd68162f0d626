"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) and a portable final export.

Layout of the local checkpoint folder::

    {checkpoint_dir}/step_00000100/         DCP shards (__N_0.distcp) + .metadata
    {checkpoint_dir}/step_00000100/COMPLETE  written by rank 0 after every rank finished (JSON)
    {checkpoint_dir}/step_00000300/model.safetensors + model_config.json   (final step only)

A folder without ``COMPLETE`` is an interrupted save and is never resumed from.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

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
    """Everything a resume needs, as DCP sees it: model, optimizer, scheduler, sampler, step."""

    def __init__(self, model, optimizer, scheduler, sampler):
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {
            "model": msd,
            "optim": osd,
            "scheduler": self.scheduler.state_dict(),
            "sampler_pos": torch.tensor(self.sampler.pos, dtype=torch.int64),
            "step": torch.tensor(self.step, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.pos = int(state["sampler_pos"])
        self.step = int(state["step"])


def save(state: TrainState, checkpoint_dir: str | Path, *, world_size: int, config_hash: str) -> Path:
    """Collective: every rank writes its shard; rank 0 marks the folder complete last."""
    path = Path(checkpoint_dir) / step_dir_name(state.step)
    dcp.save({"train": state}, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        marker = {"step": state.step, "world_size": world_size, "config_hash": config_hash}
        _atomic_write(path / COMPLETE, json.dumps(marker) + "\n")
    dist.barrier()
    return path


def latest_complete(checkpoint_dir: str | Path) -> Path | None:
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if STEP_DIR_RE.match(p.name) and (p / COMPLETE).is_file()]
    return max(done, key=lambda p: p.name, default=None)


def load(state: TrainState, path: str | Path) -> None:
    dcp.load({"train": state}, checkpoint_id=str(path), planner=_WeightsOnlyLoadPlanner())


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
        _atomic_write(path / MODEL_CONFIG_FILE, json.dumps(spec, indent=2) + "\n")
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
