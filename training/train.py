"""Training entry point: the same code by hand, under torchrun, and in a Kubernetes pod.

Launch it:

    # one process (a one-rank group on 127.0.0.1)
    python -m training train --set dataset_uri=var/data/teacher --set checkpoint_dir=var/ckpt

    # two ranks on this machine (gloo on CPU, nccl on GPUs); a dead rank restarts the group,
    # which resumes from the latest complete checkpoint
    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \
        --max-restarts 2 -m training train --config cfg.json --set strategy=fsdp --set precision=bf16

    # Kubernetes: every pod runs torchrun with --rdzv-backend c10d (see docs/architecture.md)

The loop reads as intent: load -> {maybe_stop, step, maybe_log, maybe_check_replicas, maybe_save}
-> export. Only rank 0 (``is_main``) logs to MLflow and prints progress.

Exit codes: 0 done; 2 bad config (nothing started); 75 preempted (SIGTERM): a checkpoint of the
current step was written, run the same command again to resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from training import checkpoint, distributed, metrics, precision
from training.config import ConfigError, TrainConfig
from training.data import ShardedSampler, load_split
from training.datasets import read_meta
from training.models import build_model, flops_per_sample, loss_fn, model_spec, split_batch
from training.tracking import logger_for

EXIT_PREEMPTED = 75

# Fault injection for tests and chaos drills (environment, never config, so a config file can't
# carry it into production by accident):
#   TRAINING_FAULT_KILL_AT_STEP=STEP:RANK  that rank SIGKILLs itself after STEP, first attempt only
#   TRAINING_FAULT_INF_GRAD_AT_STEP=STEP   gradients of STEP are set to inf before the optimizer step
#   TRAINING_FAULT_HANG_AT_STEP=STEP:RANK  that rank stops responding after STEP (a hung GPU, a
#                                          deadlock): its peers' next collective times out
#   TRAINING_FAULT_COMM_DELAY_MS=D         every DDP gradient collective completes D ms later
#                                          (a slow network; see distributed.CommTimer)


class Preempted(Exception):
    pass


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
    def read(cls, folder: Path) -> list[dict[str, Any]]:
        path = folder / cls.NAME
        if not path.exists():
            return []
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash mid-write
                continue
        return records

    @classmethod
    def last(cls, folder: Path) -> dict[str, Any] | None:
        records = cls.read(folder)
        return records[-1] if records else None


class _Preemption:
    """SIGTERM sets a flag; all ranks agree on it at step boundaries (a MAX all-reduce of one
    int), so every rank stops after the same step and they write one consistent checkpoint.

    Even a one-int all-reduce costs about a millisecond on a busy host (and makes every step wait
    for the slowest rank), ~10% of a small model's step here. So the check runs every ``every``
    steps, ``every`` chosen at each log window from the slowest rank's step time so that checks
    are about ``INTERVAL_S`` apart (every step for slow steps, at most ``log_every`` apart); and
    the all-reduce is launched asynchronously at one check and read at the next, behind compute.
    A SIGTERM thus stops training at most two intervals plus one step after it arrives, far
    inside the grace period. All ranks compute the same ``every`` from the same all-reduced step
    time, so they always check at the same steps.
    """

    INTERVAL_S = 0.2

    def __init__(self, grace_s: float) -> None:
        self.requested = False
        self.grace_s = grace_s
        self.every = 1  # until a step time is known
        self._pending: tuple[torch.Tensor, Any] | None = None
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.requested:  # a second SIGTERM: stop now
            os._exit(128 + signal.SIGTERM)
        self.requested = True
        # A rank stuck in a collective never reaches the step boundary; torchrun's teardown of a
        # failed group also arrives as SIGTERM. Don't outlive the grace period either way.
        import threading

        timer = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
        timer.daemon = True
        timer.start()

    def pace(self, slowest_step_s: float, log_every: int) -> None:
        """Space the checks by the step time (the same all-reduced value on every rank)."""
        self.every = max(1, min(log_every, int(self.INTERVAL_S / max(slowest_step_s, 1e-9))))

    def agreed(self, device: torch.device, step: int) -> bool:
        """True on every rank, at the same check, once any rank got SIGTERM before the previous check."""
        if step % self.every:
            return False
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
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
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
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


def _fault_env(name: str) -> str | None:
    return os.environ.get(name) or None


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Check everything that can be checked, then train. Raises ConfigError before any process
    group exists when the config, the launch size, the hardware or the dataset don't fit."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world_size(world)
    cfg.check_device(torch.cuda.is_available())
    if not cfg.checkpoint_dir:
        raise ConfigError("checkpoint_dir", "is empty", "pass a folder for checkpoints")
    try:
        meta = read_meta(cfg.dataset_uri)
    except FileNotFoundError as e:
        raise ConfigError("dataset_uri", str(e), "run `python -m training make-data` or fix the path") from None
    cfg.check_dataset(meta)
    train = load_split(cfg.dataset_uri, "train")

    info = distributed.init(cfg.collective_timeout_s)
    try:
        return Trainer(cfg, info, meta, train).fit()
    finally:
        distributed.cleanup()


class Trainer:
    def __init__(self, cfg: TrainConfig, info: distributed.DistInfo, meta: dict[str, Any], train) -> None:
        self.cfg, self.info, self.meta = cfg, info, meta
        self.kind = meta["kind"]
        self.phase = "setup"
        _seed_everything(cfg.seed)  # same seed on every rank: identical initial weights
        self.spec = model_spec(cfg.model, meta, hidden=cfg.hidden, depth=cfg.depth, n_heads=cfg.n_heads, dropout=cfg.dropout)
        self.model, self.comm_timer = distributed.parallelize(build_model(self.spec), cfg, info)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.scaler = precision.grad_scaler(cfg.precision, info.device)
        self.sampler = ShardedSampler(len(train.features), global_batch=cfg.batch_size, rank=info.rank,
                                      world_size=info.world_size, seed=cfg.seed)
        self.state = checkpoint.TrainState(self.model, self.optimizer, self.scheduler, self.sampler, self.scaler)
        self.ckpt = checkpoint.Checkpointer(cfg.checkpoint_dir, world_size=info.world_size,
                                            config_hash=cfg.config_hash(), use_async=cfg.async_checkpoint)
        self.features = torch.from_numpy(train.features)
        self.labels = torch.from_numpy(train.labels) if train.labels is not None else None
        self.logger = logger_for(info.is_main)
        self.metrics_log = metrics.OnceLogger(self.logger)  # a replayed step is not logged twice
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.flops_per_sample = flops_per_sample(self.spec, self.n_params)
        self.attempt = f"{time.time():.6f}-{os.getpid()}"  # tells this attempt's step records apart
        self.step_times: list[float] = []
        self.val = None
        if cfg.eval_every:
            val = load_split(cfg.dataset_uri, "validation")
            self.val = (torch.from_numpy(val.features), torch.from_numpy(val.labels) if val.labels is not None else None)
        self.out = Path(cfg.output_dir) if cfg.output_dir else None
        self.clock = metrics.RunClock(self.out) if info.is_main else None
        self.step_log: StepLog | None = None
        self.skipped_steps = 0
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        kill = _fault_env("TRAINING_FAULT_KILL_AT_STEP")
        self.kill_at = tuple(int(v) for v in kill.split(":")) if kill else None
        hang = _fault_env("TRAINING_FAULT_HANG_AT_STEP")
        self.hang_at = tuple(int(v) for v in hang.split(":")) if hang else None
        inf = _fault_env("TRAINING_FAULT_INF_GRAD_AT_STEP")
        self.inf_grad_at = int(inf) if inf else None

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        wall_start = time.perf_counter()
        resumed_from = checkpoint.latest_complete(cfg.checkpoint_dir)
        rng_restored = False
        if resumed_from is not None:
            self.phase = f"loading checkpoint {resumed_from.name}"
            rng_restored = checkpoint.load(self.state, resumed_from)
        if not rng_restored:
            # Fresh start, or a checkpoint from fewer ranks: per-rank streams (dropout) derived from
            # seed, step and rank, so they differ across ranks and are reproducible.
            _seed_everything(cfg.seed + 1 + 1000 * self.state.step + info.rank)
        self._announce(resumed_from)
        fault = self._fault_accounting(resumed_from)
        self.peak_flops = self._peak_flops()
        system_metrics = metrics.start_system_metrics(self.logger.run_id) if info.is_main else None

        preemption = _Preemption(cfg.preempt_grace_s)
        if info.is_main and self.out:
            self.step_log = StepLog(self.out, lag=1 if info.device.type == "cuda" else 0)
        window = self._new_window()
        first_loss = last_loss = None
        saved_step = self.state.step if resumed_from else -1
        try:
            while self.state.step < cfg.steps:
                self.phase = "preemption check"
                if preemption.agreed(info.device, self.state.step):
                    preemption.drain()
                    self.ckpt.save(self.state, final=True)
                    raise Preempted(self.state.step)
                t_step = time.perf_counter()
                loss, grad_norm, skipped = self._train_step(window)
                step_s = time.perf_counter() - t_step
                self.step_times.append(step_s)
                self.state.step += 1
                self._record_step(loss, skipped, step_s)
                if window["steps"] == 1 and first_loss is None:
                    self._log_state_bytes()
                if fault is not None:
                    failed_at = fault.pop("_failed_at")
                    self.logger.log_metrics({**fault, "fault/recovery_s": time.time() - failed_at}, step=self.state.step)
                    fault = None
                self._maybe_inject_kill()

                if self.state.step % cfg.log_every == 0 or self.state.step == cfg.steps:
                    self.phase = "metrics all-reduce"
                    stats = self._reduce_window(window, grad_norm)
                    last_loss = stats["train/loss"]
                    first_loss = last_loss if first_loss is None else first_loss
                    self.metrics_log.log_metrics(stats, step=self.state.step)
                    self._progress(stats)
                    preemption.pace(stats["perf/step_s"], cfg.log_every)
                    # Windows are contiguous: logging and printing count in the next one.
                    window = self._new_window(t0=window["t_end"])

                if cfg.eval_every and self.state.step % cfg.eval_every == 0:
                    self.phase = "evaluation"
                    t_eval = time.perf_counter()
                    self._evaluate()
                    window["eval_s"] += time.perf_counter() - t_eval  # not training time

                if cfg.replica_check_every and self.state.step % cfg.replica_check_every == 0:
                    self.phase = "replica check"
                    _check_replicas(self.model, self.state.step, info)

                self.ckpt.poll()
                if cfg.checkpoint_every and self.state.step % cfg.checkpoint_every == 0 and self.state.step < cfg.steps:
                    self.phase = f"checkpoint save at step {self.state.step}"
                    blocked = self.ckpt.save(self.state)
                    window["ckpt_s"] += blocked
                    if info.is_main:
                        print(f"checkpoint step {self.state.step}: training blocked {blocked:.4f}s "
                              f"({'async' if cfg.async_checkpoint else 'sync'})", flush=True)
                    self.metrics_log.log_metrics({"ckpt/blocking_s": blocked}, step=self.state.step)
                    saved_step = self.state.step

            self.phase = "final export"
            preemption.drain()
            self.ckpt.wait()
            final_dir = Path(cfg.checkpoint_dir) / checkpoint.step_dir_name(self.state.step)
            if saved_step != self.state.step:
                # Export the portable model before marking the folder COMPLETE, so a complete final
                # checkpoint always carries model.safetensors.
                checkpoint.export_model(self.model, final_dir, self.spec)
                self.ckpt.save(self.state, final=True)
        except Preempted:
            raise
        except Exception as e:
            # Name the rank and what it was doing: a collective timeout otherwise says only "timed out".
            raise RuntimeError(f"rank {info.rank}/{info.world_size}: {self.phase} failed at step {self.state.step}: {e}") from e
        finally:
            if self.step_log is not None:
                self.step_log.close()
            if system_metrics is not None:
                system_metrics.finish()

        run_summary = self._run_summary()

        summary = {
            "final_step": self.state.step,
            "checkpoint_path": str(final_dir.resolve()),
            "world_size": info.world_size,
            "first_logged_loss": first_loss,
            "last_logged_loss": last_loss,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "restarts": self.restarts,
            "skipped_steps": self.skipped_steps,
            "train_wall_s": time.perf_counter() - wall_start,
            "config_hash": cfg.config_hash(),
            **run_summary,
        }
        if info.is_main:
            self.logger.set_tags({"checkpoint.local_path": summary["checkpoint_path"]})
            if self.out:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"train: done at step {self.state.step}; final checkpoint {final_dir}", flush=True)
        return summary

    def _train_step(self, window: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        cfg, info = self.cfg, self.info
        self.phase = "data"
        t_data = time.perf_counter()
        idx = torch.from_numpy(self.sampler.next_indices())
        x_all = self.features[idx].to(info.device, non_blocking=True)
        y_all = self.labels[idx].to(info.device, non_blocking=True) if self.labels is not None else None
        window["data_s"] += time.perf_counter() - t_data

        self.optimizer.zero_grad(set_to_none=True)
        self.comm_timer.pop_step()  # collectives outside training steps (FSDP evaluation) don't count
        loss_sum = torch.zeros((), device=info.device)
        micro = cfg.batch_size // info.world_size // cfg.grad_accum
        for m in range(cfg.grad_accum):
            last = m == cfg.grad_accum - 1
            xb = x_all[m * micro : (m + 1) * micro]
            yb = y_all[m * micro : (m + 1) * micro] if y_all is not None else None
            inputs, target = split_batch(self.kind, xb, yb)
            self.phase = "forward/backward" + ("" if last else " (accumulation, no communication)")
            with self._sync_context(last):  # DDP decides in forward whether backward communicates
                with precision.autocast(cfg.precision, cfg.strategy, info.device):
                    loss = loss_fn(self.model(inputs), target) / cfg.grad_accum
                self.scaler.scale(loss).backward()
            if last:  # backward returned after the gradient collectives completed
                exposed = self.comm_timer.backward_done()
                if exposed is not None:
                    window["exposed"].append(exposed)
            loss_sum += loss.detach()

        self.phase = "optimizer step"
        if self.inf_grad_at == self.state.step + 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("inf"))
                    break
        self.scaler.unscale_(self.optimizer)
        # Without clipping the norm is only logged: measured at log steps (in _reduce_window).
        grad_norm = (torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                     if cfg.grad_clip > 0 else None)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        skipped = scale_before is not None and self.scaler.get_scale() < scale_before
        self.skipped_steps += int(skipped)
        self.scheduler.step()

        comm = self.comm_timer.pop_step()
        if comm.blocked_s:  # synchronous collectives (FSDP on gloo): all of their time was exposed
            window["exposed"].append(comm.blocked_s)
        window["comm_s"] += comm.seconds
        window["comm_bytes"] = comm.bytes
        window["bus_bytes"] = comm.bus_bytes
        window["collectives"] = comm.collectives
        window["loss"] += loss_sum
        window["steps"] += 1
        return loss_sum, grad_norm, skipped

    def _sync_context(self, last_micro: bool):
        """Accumulation micro-batches skip gradient communication: DDP ``no_sync``; FSDP2
        ``set_requires_gradient_sync(False)`` (the reduce-scatter runs on the last one only)."""
        if self.cfg.strategy == "ddp":
            return contextlib.nullcontext() if last_micro else self.model.no_sync()
        self.model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ bookkeeping

    def _new_window(self, t0: float | None = None) -> dict[str, Any]:
        return {"t0": time.perf_counter() if t0 is None else t0, "steps": 0, "loss": torch.zeros((), device=self.info.device),
                "comm_s": 0.0, "comm_bytes": 0, "bus_bytes": 0.0, "collectives": 0, "exposed": [], "data_s": 0.0, "ckpt_s": 0.0,
                "eval_s": 0.0}

    def _reduce_window(self, window: dict[str, Any], grad_norm: torch.Tensor | None) -> dict[str, float]:
        """Average loss and comm time over ranks; take the slowest rank's wall time (less the
        time spent evaluating, which is not training)."""
        info, cfg = self.info, self.cfg
        window["t_end"] = time.perf_counter()
        elapsed = window["t_end"] - window["t0"] - window["eval_s"]
        steps = window["steps"]
        exposed = sum(self.comm_timer.exposed_seconds(e) for e in window["exposed"])
        sums = torch.tensor([float(window["loss"]), window["comm_s"], window["data_s"], exposed], dtype=torch.float64)
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        loss_sum, comm_sum, data_sum, exposed_sum = (sums / info.world_size).tolist()
        step_s = float(slowest) / steps
        if grad_norm is None:  # gradients of the last step are still in .grad until the next zero_grad
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        stats = {
            "train/loss": loss_sum / steps,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": float(norm),
            "perf/step_s": step_s,
            "perf/samples_per_s": cfg.batch_size / step_s,
            "perf/data_wait_s": data_sum / steps,
        }
        if self.kind == "tokens":
            stats["perf/tokens_per_s"] = cfg.batch_size * self.spec["seq_len"] / step_s
        stats["perf/mfu"] = self.flops_per_sample * stats["perf/samples_per_s"] / (self.peak_flops * info.world_size)
        if self.comm_timer.timed and window["collectives"]:  # see distributed.CommTimer
            comm_s = comm_sum / steps
            stats["comm/bytes_per_step"] = float(window["comm_bytes"])
            stats["comm/collectives_per_step"] = float(window["collectives"])
            stats["comm/exposed_s_per_step"] = exposed_sum / steps
            stats["comm/exposed_fraction"] = min(1.0, exposed_sum / steps / step_s)
            # On CUDA a future's callback runs once the collective is *queued* (on a stream that
            # waits for it), so CPU clocks there say nothing about its duration: no s_per_step or
            # bus bandwidth rather than a wrong one (exposed time above uses CUDA events).
            if not self.comm_timer.cuda:
                stats["comm/s_per_step"] = comm_s
            if "comm/s_per_step" in stats and info.world_size > 1 and comm_s > 0:
                # Bus bandwidth as nccl-tests report it: each rank moves 2(n-1)/n of an all-reduce's
                # buffer, (n-1)/n of an all-gather's or reduce-scatter's; GB/s = 1e9 bytes/s.
                stats["comm/busbw_gbps"] = window["bus_bytes"] / comm_s / 1e9
        if self.scaler.is_enabled():
            stats["train/loss_scale"] = self.scaler.get_scale()
            stats["train/skipped_steps"] = float(self.skipped_steps)
        return stats

    def _progress(self, stats: dict[str, float]) -> None:
        if not self.info.is_main:
            return
        eta = (self.cfg.steps - self.state.step) * stats["perf/step_s"]
        comm = ""
        if "comm/exposed_fraction" in stats:
            took = f"{1000 * stats['comm/s_per_step']:.2f} ms/step, " if "comm/s_per_step" in stats else ""
            comm = f" | comm {took}{100 * stats['comm/exposed_fraction']:.1f}% exposed"
        scale = f" | scale {stats['train/loss_scale']:.0f} skipped {self.skipped_steps}" if "train/loss_scale" in stats else ""
        print(f"step {self.state.step}/{self.cfg.steps} | loss {stats['train/loss']:.4f} | "
              f"{stats['perf/samples_per_s']:.0f} samples/s{comm}{scale} | eta {eta:.0f}s", flush=True)

    def _announce(self, resumed_from: Path | None) -> None:
        info, cfg = self.info, self.cfg
        if not info.is_main:
            return
        where = f"resuming from {resumed_from} (step {self.state.step})" if resumed_from else "starting from scratch"
        print(f"train: {cfg.model}/{cfg.strategy}/{cfg.precision} on {info.world_size} ranks, backend={info.backend}, "
              f"device={info.device.type}, restart {self.restarts}, {where}", flush=True)
        if resumed_from is None:
            self.logger.log_params({**cfg.to_dict(), "world_size": info.world_size, "backend": info.backend,
                                    "config_hash": cfg.config_hash(),
                                    "n_params": sum(p.numel() for p in self.model.parameters())})

    def _log_state_bytes(self) -> None:
        """Parameters + optimizer state held by this rank (optimizer state exists after step 1)."""
        nbytes = distributed.local_state_bytes(self.model, self.optimizer)
        if self.info.is_main:
            print(f"memory: {nbytes} bytes of parameters + optimizer state per rank ({self.cfg.strategy})", flush=True)
            self.logger.log_metrics({"mem/state_bytes_per_rank": float(nbytes)}, step=self.state.step)

    def _peak_flops(self) -> float:
        """Rank 0: the per-rank peak FLOP/s MFU divides by, logged as params (which peak, from where)."""
        if not self.info.is_main:
            return float("nan")  # only rank 0 logs MFU
        cache = Path(self.cfg.output_dir or self.cfg.checkpoint_dir) / "peak_flops.json"
        peak, source = metrics.peak_flops(self.info.device, self.cfg.precision, cache)
        print(f"mfu: peak {peak / 1e12:.3f} TFLOP/s per rank ({source}); {self.flops_per_sample:.3g} FLOPs per sample",
              flush=True)
        self.logger.log_params({"perf/peak_flops": peak, "perf/peak_source": source,
                                "perf/flops_per_sample": self.flops_per_sample})
        return peak

    def _evaluate(self) -> None:
        """Score the validation split on all ranks (sharded), log eval/*, and the first time the
        target is reached, time_to_target_s / steps_to_target (wall time since the run's first
        attempt started training, as MLPerf counts time-to-train: evaluation included)."""
        cfg, info, step = self.cfg, self.info, self.state.step
        feats, labels = self.val
        model = self.model.module if cfg.strategy == "ddp" else self.model  # DDP: no collectives in eval
        res = metrics.evaluate_sharded(model, self.kind, feats, labels, device=info.device, rank=info.rank,
                                       world_size=info.world_size, batch=max(256, cfg.batch_size),
                                       autocast=lambda: precision.autocast(cfg.precision, cfg.strategy, info.device))
        if not info.is_main:
            return
        self.metrics_log.log_metrics(res, step=step)
        print(f"eval step {step}: loss {res['eval/loss']:.4f} | accuracy {res['eval/accuracy']:.4f}", flush=True)
        if cfg.has_target and self.clock.target() is None and metrics.target_reached(
                cfg.target_metric, res[cfg.target_metric], cfg.target_value):
            hit = self.clock.reach_target(step, time.time())
            self.metrics_log.log_metrics(hit, step=step)
            print(f"target {cfg.target_metric} {cfg.target_value} reached at step {step} after "
                  f"{hit['time_to_target_s']:.1f}s", flush=True)

    def _run_summary(self) -> dict[str, float]:
        """Goodput, wall time, samples, device-hours and peak memory per rank (metrics.lineage_summary)."""
        info = self.info
        mine = torch.tensor([metrics.peak_memory_bytes(info.device)], dtype=torch.int64, device=info.device)
        peaks = [torch.zeros_like(mine) for _ in range(info.world_size)]
        dist.all_gather(peaks, mine)
        if not info.is_main:
            return {}
        if self.out:
            records = StepLog.read(self.out)
        else:  # no output_dir: this attempt only
            records = [{"step": i, "step_s": s, "t": 0.0, "attempt": self.attempt} for i, s in enumerate(self.step_times)]
        life = metrics.lineage_summary(records, start=self.clock.start, end=time.time(), world_size=info.world_size)
        summary = {
            "goodput": life["goodput"],
            "summary/wall_s": life["wall_s"],
            "summary/productive_s": life["productive_s"],
            "summary/lost_to_restarts_s": life["lost_to_restarts_s"],
            "summary/total_samples": float(self.state.step * self.cfg.batch_size),
            "summary/device_hours": life["device_s"] / 3600,
            "summary/device_hours_lost_to_restarts": life["lost_device_s"] / 3600,
            "mem/peak_bytes_max": float(max(int(p) for p in peaks)),
            **{f"mem/peak_bytes_rank_{r}": float(p) for r, p in enumerate(peaks)},
        }
        self.logger.log_metrics_once(summary, step=self.state.step)
        print(f"summary: goodput {summary['goodput']:.3f} | wall {life['wall_s']:.1f}s | "
              f"lost to restarts {life['lost_to_restarts_s']:.1f}s | {summary['summary/device_hours']:.4f} device-hours | "
              f"peak memory {max(int(p) for p in peaks) / 2**20:.0f} MiB/rank", flush=True)
        return summary

    def _fault_accounting(self, resumed_from: Path | None) -> dict[str, float] | None:
        """After a restart: how many completed steps were lost and when the failure happened, from
        the last per-step record the previous attempt wrote. recovery_s is measured from that record
        (the last sign of life, at most one step before the failure) to the first completed step
        after the restart."""
        if not (self.info.is_main and self.out and resumed_from is not None):
            return None
        beat = StepLog.last(self.out)
        if beat is None or beat["step"] <= self.state.step:
            return None  # nothing recorded, or the previous attempt ended at this checkpoint (e.g. preemption)
        return {"fault/restarts": float(self.restarts), "fault/steps_lost": float(beat["step"] - self.state.step),
                "_failed_at": beat["t"]}

    def _record_step(self, loss: torch.Tensor, skipped: bool, step_s: float) -> None:
        """Rank 0: the exact per-step loss (float.hex) for reproducibility checks; the step's time,
        end time and attempt feed goodput (metrics.lineage_summary); the last record is the
        heartbeat fault accounting reads after a restart."""
        if self.step_log is not None:
            self.step_log.add({"step": self.state.step, "skipped": skipped, "restart": self.restarts,
                               "step_s": step_s, "t": time.time(), "attempt": self.attempt,
                               "world": self.info.world_size}, loss)

    def _maybe_inject_kill(self) -> None:
        if self.kill_at and self.restarts == 0 and self.kill_at == (self.state.step, self.info.rank):
            print(f"fault injection: rank {self.info.rank} SIGKILLs itself after step {self.state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang_at and self.restarts == 0 and self.hang_at == (self.state.step, self.info.rank):
            print(f"fault injection: rank {self.info.rank} hangs after step {self.state.step}", flush=True)
            while True:
                time.sleep(3600)
