"""What the trainer reports while it trains (``MetricsRecorder``): the per-step record
(``steps.jsonl``), log windows every ``log_every`` steps (loss, throughput, data wait,
communication, MFU: to MLflow and as the progress line), the start-up lines and the run summary
(goodput, device-hours, peak memory); ``FaultReport``: after a restart, the steps lost and the
recovery time (``fault/*``). Per step it only appends a record to a file it holds open and adds to
the window; anything needing a collective or a GPU sync waits for the window's end. The speed
figures of an attempt's first (warm-up) window go to the summary (``warmup_*``), not the series, so
they do not squash the charts. Formulas: training/metrics/formulas.py; how each figure is measured:
docs/architecture.md ("Metrics").
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from training import log
from training.distributed.comm import CommTimer
from training.distributed.parallel import DistInfo, full_tensor, local_state_bytes
from training.metrics.formulas import lineage_summary
from training.metrics.memory import Estimate, log_estimate
from training.metrics.live import LiveMetrics
from training.metrics.peak import peak_flops, peak_memory_bytes
from training.models.spec import ModelSpec
from training.metrics.steps import EtaSmoother, RunClock, StepLog, StepResult, Window
from training.tracking.system import start_system_metrics
from training.config.fields import mlflow_record
from training.log import logger
from training.util import atomic_write
from training.metrics.formulas import flops_per_sample


# Figures of a window that measure speed: the first window of an attempt (warm-up) leaves them out of
# the series and records them in the run summary as warmup_<name>.
WARMUP_KEYS = ("perf/", "comm/")
WARMUP_SUMMARY = ("perf/step_s", "perf/samples_per_s", "comm/s_per_step", "comm/exposed_fraction")
PROGRESS_EVERY_S = 5.0  # the progress tag is a write to the tracking store: not every window


MESH_DIMS = ("dp_shard", "dp_replicate")  # the dimensions whose communication is timed apart (CommTimer)


def mesh_label(cfg, world_size: int) -> str:
    """The run's layout in words, -1 degrees filled in: ``ddp x4``, ``fsdp x4`` (one sharded copy),
    ``hsdp 2x2`` (dp_replicate x dp_shard): what a comparison of runs lines up by."""
    if cfg.strategy != "fsdp":
        return f"{cfg.strategy} x{world_size}"
    replicate, shard = cfg.mesh_shape(world_size)
    return f"fsdp x{shard}" if replicate == 1 else f"hsdp {replicate}x{shard} (dp_replicate x dp_shard)"


class MetricsRecorder:
    """The trainer's reporting, one instance per rank. Only rank 0 writes ``steps.jsonl``, logs to
    MLflow (``mlflow`` is a NullLogger elsewhere) and prints (training.log); every rank takes part
    in the window's all-reduces and the summary's all-gather.

    ``on_window`` callbacks get each closed window's figures (the preemption agreement paces
    itself by ``perf/step_s``)."""

    def __init__(self, cfg, info: DistInfo, state, *, comm_timer: CommTimer,
                 spec: ModelSpec, mlflow, metrics_log, clock: RunClock | None, restarts: int,
                 phase) -> None:
        self.cfg, self.info, self.state, self.comm_timer, self.spec = cfg, info, state, comm_timer, spec
        self.mlflow, self.metrics_log, self.clock, self.restarts, self.phase = mlflow, metrics_log, clock, restarts, phase
        self.out = Path(cfg.output_dir) if cfg.output_dir else None
        self.n_params = sum(p.numel() for p in state.model.parameters())
        self.n_trainable = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
        self.flops_per_sample = flops_per_sample(spec, self.n_params, self.n_trainable)
        self.attempt = f"{time.time():.6f}-{os.getpid()}"  # tells this attempt's step records apart
        self.on_window: list[Callable[[dict[str, float]], None]] = []
        self.steps_done = 0  # by this attempt
        self.productive_s = 0.0  # this attempt's step times (the summary without output_dir)
        self.skipped_steps = 0
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.peak_flops = float("nan")
        self.step_log: StepLog | None = None
        self.fault_report: FaultReport | None = None
        self.system_metrics = None
        self.window: Window | None = None
        self._grad_norm: torch.Tensor | None = None
        self.windows = 0  # closed by this attempt; the first is warm-up
        self.compile_s = 0.0  # compile=blocks: seconds compiling, as last logged
        self.eta = EtaSmoother()
        self._progress_logged_at = -math.inf
        self.memory_estimate: Estimate | None = None  # the preflight's (training/metrics/memory.py)
        self.live = LiveMetrics(info.rank, checkpoint_every=cfg.checkpoint_every, restarts=restarts,
                                stall_after_s=cfg.stall_after_s, cuda=info.device.type == "cuda")

    # ------------------------------------------------------------------ start and end

    def start(self, resumed_from: str | None) -> None:
        """Say what runs (and log the params on a fresh start), find the MFU peak, start MLflow's
        system metrics, open ``steps.jsonl`` and the first window. After a restart, rank 0 reports
        what the failure cost once this attempt's first step is done (``FaultReport``)."""
        self._announce(resumed_from)
        self.peak_flops = self._peak_flops()
        if self.info.is_main:
            if resumed_from is not None:
                self.fault_report = FaultReport.after_restart(self.out, resumed_step=self.state.step,
                                                              restarts=self.restarts, mlflow=self.mlflow)
            self.system_metrics = start_system_metrics(self.mlflow.run_id)
            if self.out:
                self.step_log = StepLog(self.out, lag=1 if self.info.device.type == "cuda" else 0)
            if self.memory_estimate is not None:
                log_estimate(self.mlflow, self.memory_estimate)
        self.live.started(self.state.step, resumed_from is not None)
        if self.cfg.metrics_port:  # one port per rank of a node
            self.live.serve(self.cfg.metrics_host, self.cfg.metrics_port + self.info.local_rank)
        self.window = self._new_window(time.perf_counter())

    def close(self) -> None:
        self.live.close()
        if self.step_log is not None:
            self.step_log.close()
        if self.system_metrics is not None:
            self.system_metrics.finish()
        if self.info.is_main and self.out and (self.out / log.LOG_FILE).is_file():
            try:  # also after a failure: the log up to it belongs in the run
                self.mlflow.log_artifact(self.out / log.LOG_FILE, "logs")
            except Exception as e:  # the record of a run must never hide the run's own error
                logger.warning(f"train log not logged to MLflow ({e})")

    def _announce(self, resumed_from: str | None) -> None:
        cfg, info = self.cfg, self.info
        where = f"resuming from {resumed_from} (step {self.state.step})" if resumed_from else "starting from scratch"
        mesh = mesh_label(cfg, info.world_size)
        logger.info(f"train: {cfg.model}/{cfg.strategy}/{cfg.precision} on {info.world_size} ranks ({mesh}), "
                    f"backend={info.backend}, device={info.device.type}, restart {self.restarts}, {where}")
        if resumed_from is None:
            params, per_run = mlflow_record(cfg)
            self.mlflow.log_params({**params, "world_size": info.world_size, "backend": info.backend,
                                    "n_params": self.n_params, "n_trainable_params": self.n_trainable,
                                    "trainable_share": round(self.n_trainable / max(1, self.n_params), 6), "mesh": mesh})
            self.mlflow.set_tags({**per_run, "config_hash": cfg.config_hash()})
        self.mlflow.log_text(json.dumps(cfg.to_dict(), indent=2) + "\n", "train_config.json")

    def _peak_flops(self) -> float:
        """Rank 0: the per-rank peak FLOP/s MFU divides by, logged as tags (which peak, from where)."""
        if not self.info.is_main:
            return float("nan")  # only rank 0 logs MFU
        folder = self.cfg.output_dir or ("" if "://" in self.cfg.checkpoint_dir else self.cfg.checkpoint_dir)
        cache = Path(folder) / "peak_flops.json" if folder else None  # never a local path made from an s3:// URI
        client = getattr(self.mlflow, "client", None)
        logged = client.get_run(self.mlflow.run_id).data.tags if client is not None else {}
        if "perf/peak_flops" in logged and not (cache and cache.exists()):
            # A retry on another machine (an empty disk, checkpoints from the store): the run keeps
            # the peak it was logged with, so MFU stays comparable across its attempts.
            peak, source = float(logged["perf/peak_flops"]), logged.get("perf/peak_source", "")
        else:
            peak, source = peak_flops(self.info.device, self.cfg.precision, cache)
        logger.info(f"mfu: peak {peak / 1e12:.3f} TFLOP/s per rank ({source}); {self.flops_per_sample:.3g} FLOPs per sample")
        # The peak is measured on the machine (or looked up for its GPU): a tag, not a choice.
        self.mlflow.set_tags({"perf/peak_flops": peak, "perf/peak_source": source})
        self.mlflow.log_params({"perf/flops_per_sample": self.flops_per_sample})
        return peak

    # ------------------------------------------------------------------ every step

    def record(self, step: int, r: StepResult) -> None:
        """Rank 0: the exact per-step loss (float.hex) for reproducibility checks; the step's time,
        end time and attempt feed goodput (lineage_summary); the last record is the
        heartbeat fault accounting reads after a restart. Every rank: the window's sums."""
        self.steps_done += 1
        self.productive_s += r.seconds
        self.skipped_steps += int(r.skipped)
        self._grad_norm = r.grad_norm
        self.window.add(r)
        self.live.step(step, r.seconds)
        if self.step_log is not None:
            self.step_log.add({"step": step, "skipped": r.skipped, "restart": self.restarts,
                               "step_s": r.seconds, "t": time.time(), "attempt": self.attempt,
                               "world": self.info.world_size}, r.loss)
        if self.steps_done == 1:  # optimizer state exists from the first step on
            self._log_state_bytes(step)
            if self.fault_report is not None:
                self.fault_report(step)

    def maybe_log(self, step: int) -> None:
        """At every ``log_every``-th and the last step: close the window, log it, print progress."""
        if step % self.cfg.log_every and step != self.cfg.steps:
            return
        with self.phase("metrics all-reduce"):
            stats = self._window_stats()
        self.last_loss = stats["train/loss"]
        self.first_loss = self.last_loss if self.first_loss is None else self.first_loss
        self.windows += 1
        if self.windows == 1:  # warm-up: its speed is no steady-state figure
            self.metrics_log.log_metrics({k: v for k, v in stats.items() if not k.startswith(WARMUP_KEYS)}, step=step)
            self.mlflow.log_summary({"warmup_steps": float(self.window.steps),
                                     **{f"warmup_{k.split('/')[1]}": stats[k] for k in WARMUP_SUMMARY if k in stats}})
        else:
            self.metrics_log.log_metrics(stats, step=step)
        self._log_compile(step)
        eta = self.eta.update(self.window.steps, self.window.t_end - self.window.t0, first=self.windows == 1)
        eta_s = eta * (self.cfg.steps - step)
        self._progress(step, stats, eta_s)
        if step == self.cfg.steps or self.window.t_end - self._progress_logged_at >= PROGRESS_EVERY_S:
            self.mlflow.set_progress(step, self.cfg.steps, eta_s)
            self._progress_logged_at = self.window.t_end
        if self.info.is_main and self.out and self.memory_estimate is not None:
            self._write_memory(step, stats)
        for callback in self.on_window:
            callback(stats)
        self.window = self._new_window(self.window.t_end)  # logging and printing count in the next window

    def _log_compile(self, step: int) -> None:
        """compile=blocks: the seconds spent compiling so far (rank 0's; every rank compiles the same
        graphs at the same steps), logged when they grew. The steps that compiled fall in the first
        window, whose speed figures are warm-up (see WARMUP_KEYS), so step time leaves them out."""
        if self.cfg.compile == "none":
            return
        from training.models.compiling import compile_seconds

        spent = compile_seconds()
        if spent > self.compile_s:
            self.compile_s = spent
            self.metrics_log.log_metrics({"perf/compile_s": spent}, step=step)
            self.mlflow.log_summary({"compile_s": spent})

    def not_training(self, seconds: float) -> None:
        """Time inside the window that was not training (evaluation): left out of throughput."""
        self.window.not_training_s += seconds

    # ------------------------------------------------------------------ windows

    def _new_window(self, t0: float) -> Window:
        return Window(t0=t0, loss=torch.zeros((), device=self.info.device))

    def _window_stats(self) -> dict[str, float]:
        """Average loss, comm time and wall time (less the time spent evaluating, which is not
        training) over ranks. In a synchronous step every rank's window spans the same steps, so
        ranks differ only by where a busy CPU let each one read its clock at the window's edges;
        the mean telescopes over a run (the windows' sum is the ranks' mean span, exactly), while
        a per-window max adds every edge's skew up (12% slow on a loaded 2-core machine)."""
        w, info, cfg = self.window, self.info, self.cfg
        w.t_end = time.perf_counter()
        elapsed = w.t_end - w.t0 - w.not_training_s
        exposed = sum(self.comm_timer.exposed_seconds(e) for e in w.exposed)
        # One collective per window (an all-gather; the sums and the max are taken here): every
        # collective is a round trip that waits for the slowest rank.
        mine = torch.tensor([float(w.loss), w.comm_s, w.data_s, exposed, elapsed, peak_memory_bytes(info.device),
                             *(w.dim_s.get(dim, 0.0) for dim in MESH_DIMS)], dtype=torch.float64)
        ranks = [torch.empty_like(mine) for _ in range(info.world_size)]
        dist.all_gather(ranks, mine)
        every = torch.stack(ranks)
        loss_sum, comm_sum, data_sum, exposed_sum = (every[:, :4].sum(dim=0) / info.world_size).tolist()
        step_s = float(every[:, 4].mean()) / w.steps
        peaks = every[:, 5].tolist()  # each rank's peak so far (CPU: its resident set; CUDA: max allocated)
        w.dim_s = {dim: float(s) for dim, s in zip(MESH_DIMS, every[:, 6:].sum(dim=0) / info.world_size) if dim in w.dim_s}
        grad_norm = self._grad_norm
        if grad_norm is None:  # gradients of the last step are still in .grad until the next zero_grad
            grad_norm = torch.nn.utils.clip_grad_norm_(self.state.model.parameters(), float("inf"))
        stats = {
            "train/loss": loss_sum / w.steps,
            "train/lr": self.state.scheduler.get_last_lr()[0],
            "train/grad_norm": float(full_tensor(grad_norm)),
            "perf/step_s": step_s,
            "perf/samples_per_s": cfg.batch_size / step_s,
            "perf/data_wait_s": data_sum / w.steps,
            "mem/peak_bytes_max": max(peaks),
            **{f"mem/peak_bytes_rank_{r}": p for r, p in enumerate(peaks)},
        }
        if self.memory_estimate is not None:
            stats["mem/estimate_bytes"] = float(self.memory_estimate.total)
        if self.spec.kind in ("tokens", "text"):  # a classifier's rows: seq_len positions each, padding included
            stats["perf/tokens_per_s"] = cfg.batch_size * self.spec.seq_len / step_s
        stats["perf/mfu"] = self.flops_per_sample * stats["perf/samples_per_s"] / (self.peak_flops * info.world_size)
        if self.comm_timer.timed and w.comm is not None and w.comm.collectives:  # see CommTimer
            stats.update(self._comm_stats(w, comm_sum / w.steps, exposed_sum / w.steps, step_s))
        if self.state.scaler.is_enabled():
            stats["train/loss_scale"] = self.state.scaler.get_scale()
            stats["train/skipped_steps"] = float(self.skipped_steps)
        self._live_window(every, stats)
        return stats

    def _live_window(self, every: torch.Tensor, stats: dict[str, float]) -> None:
        """The live metrics of the window, from the all-gather's rows (no further collective)."""
        w, cfg, info = self.window, self.cfg, self.info
        loss, comm, data, exposed, elapsed = (every[info.rank, :5] / w.steps).tolist()
        share = cfg.batch_size / info.world_size  # samples per step of one rank
        mine = {"training_loss": loss, "training_data_wait_seconds": data,
                "training_compute_seconds": max(0.0, elapsed - exposed - data),
                "training_samples_per_second": share / elapsed if elapsed > 0 else 0.0}
        if self.comm_timer.timed and not self.comm_timer.cuda:
            mine["training_comm_seconds"] = comm
        if "perf/tokens_per_s" in stats:
            mine["training_tokens_per_second"] = mine["training_samples_per_second"] * self.spec.seq_len
        self.live.window(mine, stats, (w.t_end - w.t0) / w.steps)
        if not info.is_main:
            return
        compute = ((every[:, 4] - every[:, 3] - every[:, 2]) / w.steps).clamp(min=0).tolist()
        median = statistics.median(compute)
        run = {"training_run_samples_per_second": stats["perf/samples_per_s"],
               "training_run_step_seconds_max": float(every[:, 4].max()) / w.steps,
               "training_run_compute_seconds_max": max(compute),
               "training_run_compute_seconds_median": median,
               "training_run_straggler_ratio": max(compute) / median if median > 0 else 1.0,
               "training_run_slowest_rank": float(compute.index(max(compute))),
               "training_run_loss": stats["train/loss"]}
        if "perf/tokens_per_s" in stats:
            run["training_run_tokens_per_second"] = stats["perf/tokens_per_s"]
        self.live.run_view(run)

    def _comm_stats(self, w: Window, comm_s: float, exposed_s: float, step_s: float) -> dict[str, float]:
        stats = {
            "comm/bytes_per_step": float(w.comm.bytes),
            "comm/collectives_per_step": float(w.comm.collectives),
            "comm/exposed_s_per_step": exposed_s,
            "comm/exposed_fraction": min(1.0, exposed_s / step_s),
        }
        # On CUDA a future's callback runs once the collective is *queued* (on a stream that
        # waits for it), so CPU clocks there say nothing about its duration: no s_per_step or
        # bus bandwidth rather than a wrong one (exposed time above uses CUDA events).
        if not self.comm_timer.cuda:
            stats["comm/s_per_step"] = comm_s
            if len(w.dim_s) > 1:  # HSDP: within a shard group and across the replicas, averaged over the ranks
                stats.update({f"comm/{dim}_s_per_step": s / w.steps for dim, s in sorted(w.dim_s.items())})
            if self.info.world_size > 1 and comm_s > 0:
                # Bus bandwidth as nccl-tests report it: each rank moves 2(n-1)/n of an all-reduce's
                # buffer, (n-1)/n of an all-gather's or reduce-scatter's; GB/s = 1e9 bytes/s.
                stats["comm/busbw_gbps"] = w.comm.bus_bytes / comm_s / 1e9
        return stats

    def _progress(self, step: int, stats: dict[str, float], eta: float) -> None:
        comm = ""
        if "comm/exposed_fraction" in stats:
            took = f"{1000 * stats['comm/s_per_step']:.2f} ms/step, " if "comm/s_per_step" in stats else ""
            comm = f" | comm {took}{100 * stats['comm/exposed_fraction']:.1f}% exposed"
        scale = f" | scale {stats['train/loss_scale']:.0f} skipped {self.skipped_steps}" if "train/loss_scale" in stats else ""
        logger.info(f"step {step}/{self.cfg.steps} | loss {stats['train/loss']:.4f} | "
                    f"{stats['perf/samples_per_s']:.0f} samples/s{comm}{scale} | eta {eta:.0f}s")

    def _write_memory(self, step: int, stats: dict[str, float]) -> None:
        """``output_dir/memory.json``: the estimate's terms beside each rank's measured peak so far."""
        peaks = [stats[f"mem/peak_bytes_rank_{r}"] for r in range(self.info.world_size)]
        atomic_write(self.out / "memory.json", json.dumps({"step": step, "estimate": self.memory_estimate.to_json(),
                                                           "peak_bytes_rank": peaks}, indent=2))

    def _log_state_bytes(self, step: int) -> None:
        """Parameters + optimizer state held by this rank."""
        nbytes = local_state_bytes(self.state.model, self.state.optimizer)
        logger.info(f"memory: {nbytes} bytes of parameters + optimizer state per rank ({self.cfg.strategy})")
        self.mlflow.log_summary({"state_bytes_per_rank": float(nbytes)})

    # ------------------------------------------------------------------ the end

    def run_summary(self, step: int) -> dict[str, float]:
        """Collective. Goodput, wall time, samples, device-hours and peak memory per rank
        (lineage_summary); rank 0 logs and returns them, the others return {}."""
        info = self.info
        mine = torch.tensor([peak_memory_bytes(info.device)], dtype=torch.int64, device=info.device)
        peaks = [torch.zeros_like(mine) for _ in range(info.world_size)]
        dist.all_gather(peaks, mine)
        if not info.is_main:
            return {}
        if self.out:
            records = StepLog.iter(self.out)
        else:  # no output_dir: this attempt only, as one record carrying all of its step time
            records = [{"step": 0, "step_s": self.productive_s, "t": 0.0, "attempt": self.attempt}] if self.steps_done else []
        life = lineage_summary(records, start=self.clock.start, end=time.time(), world_size=info.world_size)
        peak_max = max(int(p) for p in peaks)
        summary = {
            "goodput": life["goodput"],
            "train_wall_s": life["wall_s"],
            "productive_s": life["productive_s"],
            "lost_to_restarts_s": life["lost_to_restarts_s"],
            "total_samples": float(step * self.cfg.batch_size),
            "device_hours": life["device_s"] / 3600,
            "device_hours_lost_to_restarts": life["lost_device_s"] / 3600,
            "peak_mem_bytes_max": float(peak_max),
            **{f"peak_mem_bytes_rank_{r}": float(p) for r, p in enumerate(peaks)},
            **({"compile_s": self.compile_s} if self.cfg.compile != "none" else {}),
        }
        self.mlflow.log_summary(summary)
        self.mlflow.set_progress(step, self.cfg.steps, 0.0)
        logger.info(f"summary: goodput {summary['goodput']:.3f} | wall {life['wall_s']:.1f}s | "
                    f"lost to restarts {life['lost_to_restarts_s']:.1f}s | {summary['device_hours']:.4f} "
                    f"device-hours | peak memory {peak_max / 2**20:.0f} MiB/rank")
        return summary


class FaultReport:
    """After a restart: how many completed steps were lost and when the failure happened, from
    the last per-step record the previous attempt wrote (``steps.jsonl``). ``fault/recovery_s`` is
    measured from that record (the last sign of life, at most one step before the failure) to
    the first completed step after the restart; all three are logged after that step, once."""

    def __init__(self, failed_at: float, metrics: dict[str, float], mlflow) -> None:
        self.failed_at, self.metrics, self.mlflow = failed_at, metrics, mlflow

    @classmethod
    def after_restart(cls, out: Path | None, *, resumed_step: int, restarts: int, mlflow) -> FaultReport | None:
        """Rank 0 with an output folder, after resuming at ``resumed_step``; None when there is
        nothing to report (nothing recorded, or the previous attempt ended at this checkpoint, as a
        preemption does)."""
        beat = StepLog.last(out) if out else None
        if beat is None or beat["step"] <= resumed_step:
            return None
        return cls(beat["t"], {"fault/restarts": float(restarts), "fault/steps_lost": float(beat["step"] - resumed_step)},
                   mlflow)

    def __call__(self, step: int) -> None:
        self.mlflow.log_metrics({**self.metrics, "fault/recovery_s": time.time() - self.failed_at}, step=step)
