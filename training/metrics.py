"""How the figures the trainer logs beside loss are computed: peak FLOP/s for MFU (a measured peak
is kept per machine), peak memory, time-to-target (``RunClock``, ``target_reached``), goodput
(``lineage_summary``), MLflow system metrics, and logging each step once (``OnceLogger``). The trainer's telemetry (training/telemetry.py)
decides when to measure and log them; evaluation during training is training/evaluate.py.

Every method is described in docs/architecture.md ("Metrics"); the tests in
tests/training/test_metrics.py check the figures against ground truths measured outside the trainer.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import time
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from training.config import higher_is_better
from training.log import logger
from training.util import atomic_write, machine_cache_dir

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: OnceLogger and the system metrics also
# serve the launching process (tracking.RelayReceiver), which never needs torch.

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' datasheets:
# (bf16 tensor cores, fp16 tensor cores, tf32 tensor cores, plain fp32). None: no such unit.
GPU_PEAK_TFLOPS: dict[str, tuple[float | None, float | None, float | None, float]] = {
    "H200": (989.0, 989.0, 494.0, 67.0),
    "H100": (989.0, 989.0, 494.0, 67.0),  # SXM; the PCIe card is lower and matches "H100 PCIE"
    "H100 PCIE": (756.0, 756.0, 378.0, 51.0),
    "A100": (312.0, 312.0, 156.0, 19.5),
    "L4": (121.0, 121.0, 60.0, 30.3),
    "A10G": (125.0, 125.0, 62.5, 31.2),
    "A10": (125.0, 125.0, 62.5, 31.2),
    "V100": (None, 125.0, None, 15.7),
    "T4": (None, 65.0, None, 8.1),
}


def _table_peak(name: str, precision: str) -> float | None:
    """The datasheet peak for ``precision`` on the GPU called ``name``; None when the table has
    no figure (then the peak is measured)."""
    import torch

    upper = name.upper()
    # Longest key first, so "H100 PCIE" wins over "H100" and "A10G" over "A10".
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key in upper:
            bf16, fp16, tf32, fp32 = GPU_PEAK_TFLOPS[key]
            if precision in ("bf16", "fp16"):
                peak = bf16 if precision == "bf16" else fp16
            else:
                peak = tf32 if (torch.backends.cuda.matmul.allow_tf32 and tf32) else fp32
            return peak * 1e12 if peak else None
    return None


def measure_matmul_flops(device: torch.device, precision: str, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a square matmul in the run's compute dtype, best of ``repeats`` (a practical
    peak for this process's threads; there is no datasheet figure for an arbitrary CPU)."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16 if (precision == "fp16" and device.type == "cuda") else torch.float32
    if device.type == "cpu" and dtype != torch.float32:
        n = min(n, 256)  # CPU half-precision matmuls can be ~100x slower: keep start-up short
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the training RNG streams untouched
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    a @ b  # warm-up (allocations, kernel selection)
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2.0 * n**3 / best


def _machine_key(device: torch.device, precision: str) -> str:
    """What a measured peak depends on: the processor, the precision, the threads, torch."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:  # platform.processor() is often empty on Linux
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
    return f"{device.type} {name} | {precision} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def _read_peak(path: Path, key: str | None = None) -> tuple[float, str] | None:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if key is not None:
        saved = saved.get(key)
    return (float(saved["peak_flops"]), saved["peak_source"]) if saved else None


def peak_flops(device: torch.device, precision: str, cache: Path | None) -> tuple[float, str]:
    """Peak FLOP/s of one rank's device and where the number comes from.

    Kept in ``cache`` (the run's folder) so that a restarted or retried run reuses the same peak
    (MLflow params cannot change value). A measured peak is also kept per machine, precision,
    thread count and torch version (``machine_cache_dir()/peak_flops.json``): later runs skip the
    measurement and share one peak, so their MFU compares across runs instead of following the
    load at each run's start. Delete that file to measure again."""
    import torch

    if cache is not None and (saved := _read_peak(cache)):
        return saved
    machine, key = machine_cache_dir() / "peak_flops.json", _machine_key(device, precision)
    peak, source = None, ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = _table_peak(name, precision)
        source = f"table: {name} {precision}" if peak else ""
    if peak is None and (saved := _read_peak(machine, key)):
        peak, source = saved
    if peak is None:
        # The matmul runs with this process's torch threads (OMP_NUM_THREADS under torchrun)
        # while the other ranks also run: what one rank can get, not the whole machine.
        peak = measure_matmul_flops(device, precision)
        n = 256 if device.type == "cpu" and precision == "bf16" else 512
        source = f"measured: {device.type} matmul {n}x{n} {precision}, {torch.get_num_threads()} threads"
        _remember_peak(machine, key, peak, source)
    if cache is not None:
        atomic_write(cache, json.dumps({"peak_flops": peak, "peak_source": source}))
    return peak, source


def _remember_peak(path: Path, key: str, peak: float, source: str) -> None:
    """Add one measured peak to the machine's file (a cache: failing to write it is no error)."""
    try:
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved[key] = {"peak_flops": peak, "peak_source": source, "measured_unix": time.time()}
        atomic_write(path, json.dumps(saved, indent=2), tmp_suffix=f".{os.getpid()}.tmp")
    except (OSError, ValueError) as e:
        logger.warning(f"mfu: peak not cached in {path} ({e})")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA ``max_memory_allocated`` (tensors), on CPU the process's
    maximum resident set size (everything: interpreter, torch, data)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class OnceLogger:
    """Logs a metric at a step only if the run has no value of it at that step yet.

    A restarted group (torchrun --max-restarts) or a retried task replays the steps after the
    latest checkpoint; they would otherwise appear twice in the run. The steps already in the run
    are read once per metric key (one query per key, not per log call, so logging stays cheap),
    then tracked here. ``RunLogger.log_metrics_once`` does the same per call, for rare metrics.
    """

    def __init__(self, logger) -> None:
        self.logger = logger
        self._seen: dict[str, set[int]] = {}

    def _steps(self, key: str) -> set[int]:
        if key not in self._seen:
            client = getattr(self.logger, "client", None)
            self._seen[key] = ({m.step for m in client.get_metric_history(self.logger.run_id, key)}
                               if client is not None else set())
        return self._seen[key]

    def log_metrics(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        if getattr(self.logger, "skips_logged_steps", False):  # tracking.RelayLogger: the receiving end reads the run
            self.logger.log_metrics_once(metrics, step=step)
            return metrics
        new = {k: v for k, v in metrics.items() if step not in self._steps(k)}
        if new:
            self.logger.log_metrics(new, step=step)
            for k in new:
                self._seen[k].add(step)
        return new


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


def start_system_metrics(run_id: str | None):
    """MLflow's own system-metrics sampler (CPU, memory, disk, network, GPU where present)
    attached to the existing run; ``resume_logging`` continues its step count after a restart.
    Returns the monitor (call ``finish()``) or None."""
    if not run_id:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=True)
        if not os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"):
            _ramp(monitor)
        monitor.start()
        return _SystemMetrics(monitor)
    except Exception as e:  # metrics about the machine must never stop training
        logger.warning(f"system metrics: not logged ({e})")
        return None


def _ramp(monitor, first_s: float = 1.0) -> None:
    """Sample after 1 s, then 2, 4, 8 s and from then on at MLflow's interval (10 s): a run of
    twenty seconds still gets several samples, a long one no more points than MLflow's default.
    The monitor's loop reads ``sampling_interval`` before every wait."""
    final, publish = monitor.sampling_interval, monitor.publish_metrics
    monitor.sampling_interval = min(first_s, final)

    def publish_then_slow_down(metrics):
        publish(metrics)
        monitor.sampling_interval = min(final, 2 * monitor.sampling_interval)

    monitor.publish_metrics = publish_then_slow_down


class _SystemMetrics:
    """MLflow's monitor publishes only when a sampling interval completes, so an attempt shorter
    than the interval (a quick retry, a restart near the end) would record nothing. ``finish``
    stops it and then publishes one last sample of the end of training."""

    def __init__(self, monitor) -> None:
        self.monitor = monitor

    def finish(self) -> None:
        m = self.monitor
        m.finish()  # joins the sampling thread and flushes what it queued
        try:
            m.collect_metrics()
            m.publish_metrics(m.aggregate_metrics())
            m.mlflow_logger.flush()
        except Exception as e:  # metrics about the machine must never stop training
            logger.warning(f"system metrics: last sample not logged ({e})")
