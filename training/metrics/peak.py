"""The peaks the trainer's figures are measured against: ``peak_flops`` for MFU (a GPU's datasheet
figure from ``GPU_PEAK_TFLOPS``, else a measured matmul peak, kept in the run's folder and per
machine, precision, thread count and torch version) and ``peak_memory_bytes``. The recorder
(training/metrics/recorder.py) decides when to measure and log them.

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
from typing import TYPE_CHECKING

from training.log import logger
from training.util import atomic_write, machine_cache_dir

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it (at module level only for type hints).

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
        n = min(n, 256)  # CPU half-precision matmuls are much slower: keep start-up short
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


