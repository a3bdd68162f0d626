"""Training entry point: the same code by hand, under torchrun, and in a Kubernetes pod.

Launch it:

    # one process (a one-rank group on 127.0.0.1)
    python -m training train --set dataset_uri=var/data/teacher --set checkpoint_dir=var/ckpt

    # two ranks on this machine (gloo on CPU, nccl on GPUs)
    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \
        -m training train --config cfg.json

    # from Airflow: the `train` task writes cfg.json and runs the torchrun line above.

The loop reads as intent: load -> {step, maybe_log, maybe_check_replicas, maybe_save} -> export.
Only rank 0 (``is_main``) logs to MLflow and prints progress.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from training import checkpoint, distributed
from training.config import TrainConfig
from training.data import ShardedSampler, load_split
from training.datasets import read_meta
from training.models import build_model, model_spec
from training.tracking import logger_for


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _check_replicas(model: torch.nn.Module, step: int, info: distributed.DistInfo) -> None:
    """Fail loudly if data-parallel replicas drifted apart (they must stay bit-identical)."""
    digest = _weights_digest(model)
    digests: list[Any] = [None] * info.world_size
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"replica check at step {step}: weights differ across ranks: {digests}")
    if info.is_main:
        print(f"replica check step {step}: identical on {info.world_size} ranks sha256={digest[:16]}", flush=True)


def run(cfg: TrainConfig) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world_size(world)  # refuse before any process group starts
    if not cfg.checkpoint_dir:
        raise ValueError("config field 'checkpoint_dir': is empty. Fix: pass a folder for checkpoints")
    meta = read_meta(cfg.dataset_uri)
    train = load_split(cfg.dataset_uri, "train")

    info = distributed.init(cfg.collective_timeout_s)
    try:
        return _train(cfg, info, meta, train)
    finally:
        distributed.cleanup()


def _train(cfg: TrainConfig, info: distributed.DistInfo, meta, train) -> dict[str, Any]:
    wall_start = time.perf_counter()
    _seed_everything(cfg.seed)  # same seed on every rank: identical initial weights
    spec = model_spec(cfg.model, meta, hidden=cfg.hidden, depth=cfg.depth)
    model, comm_timer = distributed.parallelize(build_model(spec), cfg, info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    sampler = ShardedSampler(len(train.labels), global_batch=cfg.batch_size, rank=info.rank,
                             world_size=info.world_size, seed=cfg.seed)
    state = checkpoint.TrainState(model, optimizer, scheduler, sampler)

    resumed_from = checkpoint.latest_complete(cfg.checkpoint_dir)
    if resumed_from is not None:
        checkpoint.load(state, resumed_from)
    logger = logger_for(info.is_main)
    if info.is_main:
        where = f"resuming from {resumed_from}" if resumed_from else "starting from scratch"
        print(f"train: {info.world_size} ranks, backend={info.backend}, device={info.device.type}, {where}", flush=True)
        if resumed_from is None:
            logger.log_params({**cfg.to_dict(), "world_size": info.world_size, "backend": info.backend,
                               "config_hash": cfg.config_hash(), "n_params": sum(p.numel() for p in model.parameters())})

    features = torch.from_numpy(train.features)
    labels = torch.from_numpy(train.labels)
    window = {"t0": time.perf_counter(), "steps": 0, "loss": torch.zeros((), device=info.device), "comm_s": 0.0, "data_s": 0.0}
    first_loss = last_loss = None
    saved_step = state.step if resumed_from else -1

    while state.step < cfg.steps:
        t_data = time.perf_counter()
        idx = torch.from_numpy(sampler.next_indices())
        xb, yb = features[idx].to(info.device, non_blocking=True), labels[idx].to(info.device, non_blocking=True)
        window["data_s"] += time.perf_counter() - t_data

        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        optimizer.step()
        scheduler.step()
        state.step += 1

        comm_s, _ = comm_timer.pop_step()
        window["comm_s"] += comm_s
        window["loss"] += loss.detach()
        window["steps"] += 1

        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            stats = _reduce_window(window, info, cfg.batch_size)
            last_loss = stats["train/loss"]
            first_loss = last_loss if first_loss is None else first_loss
            stats.update({"train/lr": scheduler.get_last_lr()[0], "train/grad_norm": float(grad_norm)})
            logger.log_metrics(stats, step=state.step)
            if info.is_main:
                eta = (cfg.steps - state.step) * stats["perf/step_s"]
                print(f"step {state.step}/{cfg.steps} | loss {stats['train/loss']:.4f} | "
                      f"{stats['perf/samples_per_s']:.0f} samples/s | comm {1000 * stats['comm/s_per_step']:.2f} ms/step | "
                      f"eta {eta:.0f}s", flush=True)
            window.update(t0=time.perf_counter(), steps=0, loss=torch.zeros((), device=info.device), comm_s=0.0, data_s=0.0)

        if cfg.replica_check_every and state.step % cfg.replica_check_every == 0:
            _check_replicas(model, state.step, info)

        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
            checkpoint.save(state, cfg.checkpoint_dir, world_size=info.world_size, config_hash=cfg.config_hash())
            saved_step = state.step

    final_dir = Path(cfg.checkpoint_dir) / checkpoint.step_dir_name(state.step)
    if saved_step != state.step:
        # Export the portable model before marking the folder COMPLETE, so a complete final
        # checkpoint always carries model.safetensors.
        checkpoint.export_model(model, final_dir, spec)
        checkpoint.save(state, cfg.checkpoint_dir, world_size=info.world_size, config_hash=cfg.config_hash())

    summary = {
        "final_step": state.step,
        "checkpoint_path": str(final_dir.resolve()),
        "world_size": info.world_size,
        "first_logged_loss": first_loss,
        "last_logged_loss": last_loss,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "train_wall_s": time.perf_counter() - wall_start,
        "config_hash": cfg.config_hash(),
    }
    if info.is_main:
        logger.set_tags({"checkpoint.local_path": summary["checkpoint_path"]})
        if cfg.output_dir:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.output_dir) / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"train: done at step {state.step}; final checkpoint {final_dir}", flush=True)
    return summary


def _reduce_window(window: dict[str, Any], info: distributed.DistInfo, global_batch: int) -> dict[str, float]:
    """Average loss and comm time over ranks; take the slowest rank's wall time."""
    elapsed = time.perf_counter() - window["t0"]
    steps = window["steps"]
    sums = torch.tensor([float(window["loss"]), window["comm_s"], window["data_s"]], dtype=torch.float64)
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    loss_sum, comm_sum, data_sum = (sums / info.world_size).tolist()
    step_s = float(slowest) / steps
    return {
        "train/loss": loss_sum / steps,
        "perf/step_s": step_s,
        "perf/samples_per_s": global_batch / step_s,
        "perf/data_wait_s": data_sum / steps,
        "comm/s_per_step": comm_sum / steps,
    }
