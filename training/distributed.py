"""Process-group set-up and ``parallelize(model, cfg)``: parallelism applied from outside the model."""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(timeout_s: int) -> DistInfo:
    """Join the process group torchrun set up (env://); a single plain process also works."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "RANK" not in os.environ:
        # Run by hand without torchrun: a one-rank group on loopback keeps one code path.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"backend": backend, "timeout": timeout, "device_id": device if backend == "nccl" else None}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store for the whole job, and a restarted group would read the
        # previous attempt's gloo/nccl addresses under the same keys (and hang connecting to dead
        # ranks). A prefix per restart attempt keeps every attempt's keys apart.
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                    is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        kwargs.update(store=dist.PrefixStore(f"training/attempt_{attempt}", agent_store), rank=rank, world_size=world)
    dist.init_process_group(**kwargs)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device, backend=backend)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CommTimer:
    """Wall time during which at least one gradient collective was in flight.

    How it is measured: the DDP comm hook stamps ``perf_counter()`` when DDP hands a bucket to
    the hook (the all-reduce is launched right then) and again in the future's completion
    callback. Buckets overlap in time, so summing them would overcount; we take the length of the
    union of the [launch, done] intervals of one step. It includes time the collective waited
    for the slowest peer, which is communication cost as a user experiences it.

    What part of it the step waited for (``exposed``): DDP hands the last bucket to the hook when
    autograd has produced the last gradient; from then on backward has no compute left and only
    waits for the reducer's futures (``loss.backward()`` returns after they complete). So the time
    from the last launch to the return of ``backward()`` is exactly the communication that was not
    hidden behind compute. On CUDA the CPU clock says nothing about the GPU, so the same two
    moments are CUDA events on the compute stream, resolved when the log window closes.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self.bytes = 0
        self.collectives = 0
        self.step_collectives = 0  # collectives of the step last popped
        self.cuda = device is not None and device.type == "cuda"
        self.last_launch: float | None = None
        self.last_launch_event = None  # CUDA only
        # Test-only fault injection: every collective completes d ms later (a slow network).
        self.delay_s = float(os.environ.get("TRAINING_FAULT_COMM_DELAY_MS") or 0) / 1000

    def launched(self) -> float:
        """Called by the hook when DDP hands it a bucket; returns the launch time."""
        now = time.perf_counter()
        self.last_launch = now
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.last_launch_event = ev
        return now

    def backward_done(self):
        """Call right after a communicating ``backward()`` returned. Returns the exposed time in
        seconds (CPU) or a pair of CUDA events to resolve later with ``exposed_seconds``; None if
        no collective was launched."""
        if self.last_launch is None:
            return None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            pair, self.last_launch_event, self.last_launch = (self.last_launch_event, end), None, None
            return pair
        exposed, self.last_launch = max(0.0, time.perf_counter() - self.last_launch), None
        return exposed

    @staticmethod
    def exposed_seconds(measured) -> float:
        if measured is None:
            return 0.0
        if isinstance(measured, tuple):
            start, end = measured
            end.synchronize()
            return max(0.0, start.elapsed_time(end) / 1000)
        return measured

    def record(self, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._intervals.append((start, end))
            self.bytes += nbytes
            self.collectives += 1

    def pop_step(self) -> tuple[float, int]:
        """Seconds of in-flight communication and bytes reduced since the last call (the number of
        collectives is in ``pop_collectives``)."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
            nbytes, self.bytes = self.bytes, 0
            self.step_collectives, self.collectives = self.collectives, 0
        total, cur_start, cur_end = 0.0, None, None
        for s, e in intervals:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            total += cur_end - cur_start
        return total, nbytes


def _timed(inner):
    """Wrap a stock DDP comm hook so that each bucket's collective is timed (see CommTimer)."""

    # No annotations: DDP inspects them and `from __future__ import annotations` turns them into strings.
    def hook(timer, bucket):
        start = timer.launched()
        buf = bucket.buffer()
        # Bytes on the wire per rank: the compressing hooks send half-width copies.
        width = 2 if inner in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook) else buf.element_size()
        nbytes = buf.numel() * width
        fut = inner(None, bucket)  # None: the default process group; averages over ranks
        if timer.delay_s:
            def slow(f, d=timer.delay_s):
                time.sleep(d)  # runs where the future completes (the backend's thread), not in backward
                return f.value()

            fut = fut.then(slow)

        def done(f):
            timer.record(start, time.perf_counter(), nbytes)
            return f.value()

        return fut.then(done)

    return hook


HOOKS = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
         "bf16": default_hooks.bf16_compress_hook}


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules FSDP2 shards one by one: transformer blocks; else each conv/linear layer."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def parallelize(model: nn.Module, cfg, info: DistInfo) -> tuple[nn.Module, CommTimer]:
    """Wrap ``model`` for ``cfg.strategy``; returns the wrapped model and its comm timer.

    ddp: DistributedDataParallel with bucketed all-reduce overlapped with backward, gradients as
    views into the buckets (no extra copy), and the chosen (timed) comm hook.
    fsdp: FSDP2 ``fully_shard`` on every unit from ``_shard_units`` and then the root; with
    precision=bf16 parameters are all-gathered and computed in bf16, gradients reduced in fp32.
    """
    model = model.to(info.device)
    timer = CommTimer(info.device)
    if cfg.strategy == "ddp":
        wrapped = DDP(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        wrapped.register_comm_hook(timer, _timed(HOOKS[cfg.comm_hook]))
        return wrapped, timer
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.precision == "bf16" else MixedPrecisionPolicy()
        for unit in _shard_units(model):
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, timer
    raise ValueError(f"unknown strategy {cfg.strategy!r}")


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for parameters and optimizer state (the local shard under FSDP)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += local(v).numel() * local(v).element_size()
    return total
