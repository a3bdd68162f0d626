"""Process-group set-up and ``parallelize(model, cfg)``: parallelism applied from outside the model.

Everything that differs between DDP and FSDP2 is here, so the training loop never asks which one
runs: ``gradient_sync`` (accumulation micro-batches that skip communication), ``for_evaluation``
(the module to score without collectives where possible), ``full_tensor`` (a sharded tensor made
whole) and ``local_state_bytes``; and the communication timing both report (``CommTimer``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from training.models import shard_units
from training.util import free_port


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
        os.environ.setdefault("MASTER_PORT", str(free_port()))
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


# The default group's Python handle from cleanup() to release(), and the DDP modules alive; see cleanup().
_held: list[Any] = []
_ddp_alive: weakref.WeakSet = weakref.WeakSet()


def cleanup() -> None:
    """Destroy the process group, keeping its Python handle until ``release()``.

    Why the handle: a gloo group's C++ destructor joins its worker threads. Its Python handle
    releases the GIL before destroying it; DDP's Reducer, whose binding keeps the GIL, does not.
    A worker that has just finished a collective frees that collective's tensors, which needs
    the GIL when Python created them (``broadcast_object_list``'s, at the end of every checkpoint
    save). If the Reducer holds the last reference, the join with the GIL held waits for a worker
    that waits for the GIL: the rank hangs at exit until torchrun kills it (pytorch/pytorch#56297;
    seen after a preemption, whose exception keeps the model alive past this call). With the
    handle kept, the Reducer never holds the last reference.
    """
    if dist.is_initialized():
        _held.append(dist.group.WORLD)
        dist.destroy_process_group()


def release() -> None:
    """Drop the handle ``cleanup()`` kept, once training's exception (if any) is gone. A DDP model
    still alive (kept by a reference cycle) keeps it until the interpreter exits, when the
    workers are long idle."""
    if not _ddp_alive:
        _held.clear()


class CommTimer:
    """Wall time during which at least one gradient (DDP) or parameter/gradient (FSDP) collective
    was in flight.

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

    FSDP2 (CPU/gloo): each unit's all-gather (forward, and again in backward for resharded units)
    and reduce-scatter go through ``TimedAllGather`` / ``TimedReduceScatter``, FSDP2's public
    custom-collective hooks. On gloo FSDP2 issues them synchronously from the training thread, so
    each one's [call, return] is both its duration and time the step was blocked: all of it is
    exposed (``blocked_s``). On CUDA FSDP2 runs them on its own streams, which the CPU clock can't
    time; there no FSDP comm figures are logged rather than wrong ones.

    Bytes: the collective's full buffer (the bucket for all-reduce, the unsharded output of an
    all-gather, the unsharded input of a reduce-scatter). ``bus_bytes`` weights them as
    nccl-tests' bus bandwidth does: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
    reduce-scatter.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self.bytes = 0
        self.bus_bytes = 0.0
        self.blocked_s = 0.0
        self.collectives = 0
        self.cuda = device is not None and device.type == "cuda"
        self.timed = True  # False where the strategy's collectives are not timed (FSDP on CUDA)
        self.last_launch: float | None = None
        self.last_launch_event = None  # CUDA only
        # Every collective completes this much later (a slow network): set only by faults.install.
        # One link: delayed collectives queue behind each other (gloo completes buckets on
        # several threads), so each of N collectives in flight adds the delay, as on a saturated wire.
        self.delay_s = 0.0
        self.link = threading.Lock()

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

    def record(self, start: float, end: float, nbytes: int, bus_factor: float, blocking: bool = False) -> None:
        with self._lock:
            self._intervals.append((start, end))
            self.bytes += nbytes
            self.bus_bytes += nbytes * bus_factor
            self.collectives += 1
            if blocking:
                self.blocked_s += end - start

    def pop_step(self) -> "CommStep":
        """Communication since the last call: seconds with a collective in flight, bytes, bus
        bytes, collectives, and seconds the training thread was blocked in a synchronous one."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
            nbytes, self.bytes = self.bytes, 0
            bus, self.bus_bytes = self.bus_bytes, 0.0
            blocked, self.blocked_s = self.blocked_s, 0.0
            collectives, self.collectives = self.collectives, 0
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
        return CommStep(seconds=total, bytes=nbytes, bus_bytes=bus, collectives=collectives, blocked_s=blocked)


@dataclass
class CommStep:
    seconds: float
    bytes: int
    bus_bytes: float
    collectives: int
    blocked_s: float


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
                with timer.link:
                    time.sleep(d)  # runs where the future completes (the backend's thread), not in backward
                return f.value()

            fut = fut.then(slow)

        n = dist.get_world_size()

        def done(f):
            timer.record(start, time.perf_counter(), nbytes, 2 * (n - 1) / n)
            return f.value()

        return fut.then(done)

    return hook


def _fsdp_timed_comms(timer: CommTimer):
    """FSDP2 all-gather / reduce-scatter objects that time each call (see CommTimer). They
    subclass FSDP2's stock ones (which live in a private module; ``set_custom_all_gather`` and
    ``set_custom_reduce_scatter`` are the public way in) and only add the clock around them."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def timed(call, nbytes: int, group) -> Any:
        start = time.perf_counter()
        work = call()
        n = group.size()
        if work is None:  # synchronous: the training thread waited for all of it
            if timer.delay_s:
                time.sleep(timer.delay_s)  # test-only: a slower network
            timer.record(start, time.perf_counter(), nbytes, (n - 1) / n, blocking=True)
            return None
        work.get_future().then(lambda f: timer.record(start, time.perf_counter(), nbytes, (n - 1) / n))
        return work

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            nbytes = output_tensor.numel() * output_tensor.element_size()
            return timed(lambda: super(TimedAllGather, self).__call__(output_tensor, input_tensor, group, async_op),
                         nbytes, group)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            nbytes = input_tensor.numel() * input_tensor.element_size()
            return timed(lambda: super(TimedReduceScatter, self).__call__(output_tensor, input_tensor, group, op, async_op),
                         nbytes, group)

    return TimedAllGather(), TimedReduceScatter()


HOOKS = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
         "bf16": default_hooks.bf16_compress_hook}


def parallelize(model: nn.Module, cfg, info: DistInfo) -> tuple[nn.Module, CommTimer]:
    """Wrap ``model`` for ``cfg.strategy``; returns the wrapped model and its comm timer.

    ddp: DistributedDataParallel with bucketed all-reduce overlapped with backward, gradients as
    views into the buckets (no extra copy), and the chosen (timed) comm hook.
    fsdp: FSDP2 ``fully_shard`` on every unit from ``models.shard_units`` (the model's
    ``fsdp_units``: transformer blocks, the built-ins' linear/conv layers, a user's list; else each
    direct child holding parameters) and then the root; with
    precision=bf16 parameters are all-gathered and computed in bf16, gradients reduced in fp32.
    """
    model = model.to(info.device)
    timer = CommTimer(info.device)
    if cfg.strategy == "ddp":
        wrapped = DDP(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        wrapped.register_comm_hook(timer, _timed(HOOKS[cfg.comm_hook]))
        _ddp_alive.add(wrapped)
        return wrapped, timer
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.precision == "bf16" else MixedPrecisionPolicy()
        units = [*shard_units(model), model]
        for unit in units:
            fully_shard(unit, mp_policy=mp)
        timer.timed = info.device.type == "cpu"  # see CommTimer: CUDA streams are not timed
        if timer.timed:
            all_gather, reduce_scatter = _fsdp_timed_comms(timer)
            for unit in units:
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)
        return model, timer
    raise ValueError(f"unknown strategy {cfg.strategy!r}")


def gradient_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch's forward and backward. ``sync=False`` (an accumulation
    micro-batch) skips gradient communication: DDP ``no_sync`` (DDP decides in forward whether
    backward communicates); FSDP2 ``set_requires_gradient_sync(False)`` (the reduce-scatter then
    runs on the last micro-batch only)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if sync else model.no_sync()
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def for_evaluation(model: nn.Module) -> nn.Module:
    """The module to score with: DDP's inner module (every rank holds all weights; no collectives
    in evaluation); FSDP2's model itself (its forward all-gathers the parameters)."""
    return model.module if isinstance(model, DDP) else model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameters, a norm over them) gathered whole (a collective);
    a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
