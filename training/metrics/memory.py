"""The estimate of one rank's peak memory, in named terms (``Estimate``): parameters, gradients,
AdamW state and, under FSDP, the all-gathered units, sized from the model's parameters; the
activations (with the temporaries of one training step) counted by running the step on fake
tensors, so a built-in, ``hf:`` or factory model with activation checkpointing and autocast is
measured as it runs; the data the rank holds; the allocator's slack; the process itself.
What each term is and how it was calibrated: docs/architecture.md "Memory estimate and preflight".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from training.log import logger
from training.util import atomic_write, machine_cache_dir

GiB, MiB = 1 << 30, 1 << 20
# A rank's process before its model (python, torch, numpy, pyarrow, gloo's process group) on CPU,
# measured by benchmarks/peak_memory_bench.py (docs/benchmarks.md); a CUDA rank's budget is its
# free device memory, which the process itself does not use.
BASELINE_CPU = 440 * MiB
# The torchrun agent beside the ranks of one machine (measured as above).
AGENT_CPU = 200 * MiB
# Freed-but-kept heap and fragmentation, as a share of the activations (the bytes that come and go
# each step): measured on CPU with the malloc thresholds of ``tame_malloc``; CUDA's caching allocator.
ALLOCATOR_SHARE = {"cpu": 0.1, "cuda": 0.25}
# FSDP2 holds a unit's full parameters while the next is prefetched and, in backward, its full
# gradients beside them (measured: benchmarks/peak_memory_bench.py).
FSDP_UNITS_HELD = 3
_VERSION = 3  # of the cached activation counts: bump when what is counted changes


@dataclass
class Estimate:
    """One rank's estimated peak, in bytes, by term, and what it was estimated for."""

    terms: dict[str, int]
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def to_json(self) -> dict[str, Any]:
        return {"total_bytes": self.total, "terms_bytes": dict(self.terms), "setup": dict(self.setup)}

    def line(self) -> str:
        """``2.1 GiB = parameters 0.4 GiB + gradients ...``: the total and its non-zero terms."""
        parts = " + ".join(f"{k} {gib(v)}" for k, v in self.terms.items() if v)
        return f"{gib(self.total)} = {parts}"


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def tame_malloc(threshold: int = 32 * MiB) -> bool:
    """glibc keeps freed heap blocks, so a CPU rank's resident set after a step follows the
    allocation history, not what is live: blocks of ``threshold`` and more are mapped and unmapped
    on their own, and the heap is trimmed past it. Smaller tensors are reused from the heap: each
    one above the threshold is mapped and zero-filled afresh at every step (4 MiB cost a small
    GPT-2's LoRA step 39%: docs/benchmarks.md, "LoRA"). False where it is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD, threshold))


# --------------------------------------------------------------------------- counted on fake tensors


@dataclass(frozen=True)
class StepCount:
    """What one training step of a model holds, counted on fake tensors (no memory, no compute)."""

    param_bytes: int  # the model's parameters as built (fp32)
    param_numel: int
    largest_unit_numel: int  # the largest FSDP unit (a block), parameters
    root_numel: int  # the parameters in no unit (embedding, head, norms): the root's FSDP group
    activation_bytes: int  # the step's peak of what is neither parameter nor gradient: saved tensors, temporaries
    trainable_numel: int  # the parameters that train (an adapter's, not its frozen base)


def _activation_tracker():
    """torch's MemTracker, also keeping the peak over the step of what is live besides parameters,
    buffers and gradients (its own peak is of the total, where gradients may outweigh activations)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class ActivationPeak(MemTracker):
        activation_peak = 0

        def _update_peak_stats(self, peak_state) -> None:  # called after every operation
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                kinds = {str(k).rpartition(".")[2]: v for k, v in snap.items()}
                live = kinds["Total"] - kinds.get("PARAM", 0) - kinds.get("BUFFER", 0) - kinds.get("GRAD", 0)
                self.activation_peak = max(self.activation_peak, live)

    return ActivationPeak()


def count_step(spec, example_shape: tuple[int, ...], example_dtype: str, *, micro_batch: int,
               activation_checkpointing: str, precision: str, label_dtype: str | None = None) -> StepCount:
    """Build the model on fake tensors, apply activation checkpointing, run forward and backward
    of one micro-batch under the run's autocast, and take the step's peak from torch's MemTracker
    (``torch.distributed._tools.mem_tracker``: it follows every storage's life under fake tensors)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from training.models import activations
    from training.models.build import Tabular, build_model, fsdp_layout
    from training.models.loss import loss_fn, split_batch

    with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(spec).train()
        inner = model.model if isinstance(model, Tabular) else model
        activations.apply(inner, activation_checkpointing)
        units = fsdp_layout(inner)
        unit_params = [sum(p.numel() for p in u.parameters()) for u in units]
        in_units = {id(p) for u in units for p in u.parameters()}
        root_numel = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
        params = list(model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        for p in params:  # MemTracker hooks every parameter's gradient; a frozen base's saved inputs are
            p.requires_grad_(True)  # still kept for the adapters' backward, and gradients are not activations
        x = torch.zeros((micro_batch, *example_shape), dtype=getattr(torch, example_dtype))
        # Packed SFT windows' labels (tokens with labels) are counted as a language model's step: the
        # same activations but for the block mask ([batch, 1, seq, seq] booleans, small beside them).
        y = torch.zeros((micro_batch,), dtype=getattr(torch, label_dtype)) if label_dtype and spec.kind != "tokens" else None
        inputs, target = split_batch(spec.kind, x, y)
        tracker = _activation_tracker()
        tracker.track_external(model)
        autocast = (torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
                    if precision != "fp32" else torch.autocast("cpu", enabled=False))
        with tracker:
            with autocast:
                loss = loss_fn(model(inputs), target, task=spec.task, target_var=spec.target_variance)
            loss.backward()
        return StepCount(param_bytes=sum(p.numel() * p.element_size() for p in params),
                         param_numel=sum(p.numel() for p in params),
                         largest_unit_numel=max(unit_params, default=0), root_numel=root_numel,
                         activation_bytes=int(tracker.activation_peak), trainable_numel=trainable)


def cached_count(spec, example_shape, example_dtype, **kw) -> StepCount:
    """``count_step`` kept per model, input and step settings in the machine's cache (a lock
    around it: the ranks of one machine count once)."""
    from filelock import FileLock

    import torch

    key_src = json.dumps({"spec": spec.to_json(), "shape": list(example_shape), "dtype": example_dtype, **kw,
                          "torch": torch.__version__, "v": _VERSION}, sort_keys=True, default=str)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    folder = machine_cache_dir() / "memory_estimate"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    with FileLock(str(path) + ".lock"):
        try:
            return StepCount(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        counted = count_step(spec, tuple(example_shape), example_dtype, **kw)
        atomic_write(path, json.dumps(dataclasses.asdict(counted)), tmp_suffix=".tmp")
        return counted


# --------------------------------------------------------------------------- the estimate


def estimate(cfg, spec, example, *, world_size: int, device: str = "cpu", data_bytes: int = 0,
             baseline: int | None = None, labels_dtype: str | None = None) -> Estimate:
    """One rank's peak for ``cfg`` (strategy, precision, batch_size, grad_accum,
    activation_checkpointing) on ``world_size`` ranks. ``example``: one row of model input (a numpy
    array: its shape and dtype). ``data_bytes``: the data the rank holds (on CPU).
    ``baseline``: the process before the model (default: ``BASELINE_CPU`` on CPU, 0 on CUDA)."""
    micro = max(1, cfg.batch_size // world_size // cfg.grad_accum)
    counted = cached_count(spec, tuple(example.shape), str(example.dtype), micro_batch=micro,
                           activation_checkpointing=cfg.activation_checkpointing, precision=_autocast(cfg),
                           label_dtype=labels_dtype)
    return estimate_from(counted, cfg, world_size=world_size, device=device, data_bytes=data_bytes,
                         baseline=baseline, micro_batch=micro)


def estimate_run(cfg, spec, train, *, world_size: int, device: str = "cpu", baseline: int | None = None) -> Estimate:
    """``estimate`` for a run's train split (``data.dataset.Split``): its first row is the model's
    input; every rank holds the whole split, or a streamed split's buffer (``held_bytes``)."""
    labels = train.labels
    data = train.features.nbytes + (labels.nbytes if labels is not None else 0)
    if getattr(train, "held_bytes", None) is not None:
        data = train.held_bytes
    return estimate(cfg, spec, train.features[0], world_size=world_size, device=device, data_bytes=data,
                    baseline=baseline, labels_dtype=str(labels.dtype) if labels is not None else None)


def _autocast(cfg) -> str:
    """The precision the forward runs in (FSDP2's bf16 casts parameters, which computes the same)."""
    return cfg.precision


def estimate_from(c: StepCount, cfg, *, world_size: int, device: str, data_bytes: int, baseline: int | None,
                  micro_batch: int) -> Estimate:
    """The terms from a step's count: the sizing rules of DDP, FSDP2 and AdamW."""
    # Sharded over one row of the mesh: every rank under plain FSDP, dp_shard ranks under HSDP.
    n = cfg.mesh_shape(world_size)[1] if cfg.strategy == "fsdp" else 1
    trained = c.trainable_numel * 4  # gradients and AdamW state exist for these only (an adapter's, not its frozen base)
    if cfg.strategy == "fsdp":
        # Every rank holds 1/N of each unit (padded to N equal shards); the units' full
        # parameters (in bf16 under mixed precision) exist while they compute, the root's all step.
        full = 2 if cfg.precision == "bf16" else 4
        units = (FSDP_UNITS_HELD * c.largest_unit_numel + c.root_numel) * full
        # a unit's full gradients before reduce-scatter (the trained share of them)
        units += math.ceil((c.largest_unit_numel + c.root_numel) * 4 * c.trainable_numel / max(1, c.param_numel))
    else:
        units = 0
    acts = c.activation_bytes
    terms = {
        "baseline": BASELINE_CPU if baseline is None and device == "cpu" else int(baseline or 0),
        "data": int(data_bytes) if device == "cpu" else 0,
        "parameters": math.ceil(c.param_bytes / n),
        # DDP's gradients are views into its buckets, kept between steps; FSDP2's are sharded.
        "gradients": math.ceil(trained / n),
        "optimizer": math.ceil(2 * trained / n),  # AdamW: exp_avg and exp_avg_sq in fp32
        "fsdp_units": int(units),
        # PowerSGD: its error feedback (a gradient's size, kept between steps) and, while a bucket is
        # compressed, the copy it measures the error against.
        "compression": 2 * trained if cfg.comm_hook == "powersgd" else 0,
        "activations": int(acts),
        "allocator": int(ALLOCATOR_SHARE.get(device, 0.5) * acts),
    }
    setup = {"strategy": cfg.strategy, "world_size": world_size, "dp_shard": n, "precision": cfg.precision,
             "activation_checkpointing": cfg.activation_checkpointing, "batch_size": cfg.batch_size,
             "grad_accum": cfg.grad_accum, "micro_batch": micro_batch, "device": device,
             "parameters": c.param_numel, "trained_parameters": c.trainable_numel, "largest_unit_parameters": c.largest_unit_numel,
             "root_parameters": c.root_numel}
    return Estimate(terms=terms, setup=setup)


def log_estimate(mlflow, est: Estimate) -> None:
    """``memory_estimate.json`` (the terms) in the run; the recorder logs ``mem/estimate_bytes``
    every window beside the measured ``mem/peak_bytes_*``. A failure to log is only a warning."""
    if mlflow is None:
        return
    try:
        mlflow.log_text(json.dumps(est.to_json(), indent=2), "memory_estimate.json")
    except Exception as e:  # noqa: BLE001 - tracking must not stop training
        logger.warning(f"memory: estimate not logged ({type(e).__name__}: {e})")
