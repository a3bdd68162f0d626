"""``CommTimer``: how long gradient and parameter collectives are in flight, and how much of
that the step waits for (exposed), for DDP and FSDP2 alike."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

log = logging.getLogger(__name__)


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
        # Seconds per mesh dimension (FSDP2 on gloo, whose collectives run one at a time):
        # dp_shard (all-gather, reduce-scatter within a shard group), dp_replicate (HSDP's all-reduce).
        self._dims: dict[str, float] = {}
        self.last_collective_end = 0.0

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

    def record(self, start: float, end: float, nbytes: int, bus_factor: float, blocking: bool = False,
               dim: str | None = None) -> None:
        with self._lock:
            if dim is not None:
                self._dims[dim] = self._dims.get(dim, 0.0) + (end - start)
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
            dims, self._dims = self._dims, {}
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
        return CommStep(seconds=total, bytes=nbytes, bus_bytes=bus, collectives=collectives, blocked_s=blocked,
                        by_dim=dims)


@dataclass
class CommStep:
    seconds: float
    bytes: int
    bus_bytes: float
    collectives: int
    blocked_s: float
    by_dim: dict[str, float] = field(default_factory=dict)  # seconds per mesh dimension (FSDP2 on gloo)


def stock_sender(inner):
    """A stock DDP comm hook (``default_hooks``) as ``_timed`` takes it: bucket -> (future, bytes sent
    per rank); the compressing hooks send half-width copies."""
    half = inner in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)

    def send(bucket):
        buf = bucket.buffer()
        return inner(None, bucket), buf.numel() * (2 if half else buf.element_size())  # None: the default group

    return send


def _timed(send):
    """A DDP comm hook that times each bucket's collective (see CommTimer) around ``send``
    (bucket -> (future averaging the bucket over the ranks, bytes this rank sends))."""

    # No annotations: DDP inspects them and `from __future__ import annotations` turns them into strings.
    def hook(timer, bucket):
        start = timer.launched()
        fut, nbytes = send(bucket)
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


class PowerSGD:
    """comm_hook=powersgd: torch's PowerSGD hook (Vogels et al. 2019) with error feedback and warm
    start. Each weight matrix's gradient is sent as two rank-r factors, after ``warmup_steps``
    steps of plain all-reduce; what compression loses stays in a per-rank error buffer added to the
    next step's gradient. That state (and the factors reused as the next step's start, and the RNG
    that draws them) is this rank's own: ``state_dict`` / ``load_state_dict`` keep it in the
    checkpoint beside the RNG states, so a resumed run continues as if never stopped.

    Why state is moved between layouts here: torch keeps it per DDP bucket, as one flat tensor
    per bucket index, and DDP lays buckets out anew after a model's first step (by the order its
    gradients became ready), so a resumed run's first step sees other buckets than the ones saved.
    The state is therefore saved per parameter, and packed into whatever bucket a parameter is in
    when that bucket's layout is one it has not seen."""

    def __init__(self, module: nn.Module, *, rank: int, warmup_steps: int, seed: int, device: torch.device) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self._hook, self._should_compress = powerSGD_hook.powerSGD_hook, powerSGD_hook._should_compress
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps,
            use_error_feedback=True, warm_start=True, random_seed=seed)
        self.device = device
        self._name = {id(p): name for name, p in module.named_parameters()}
        self._shapes = {name: list(p.shape) for name, p in module.named_parameters()}  # a gradient's is its parameter's
        self._sizes = {name: p.numel() for name, p in module.named_parameters()}
        self._names: dict[int, list[str]] = {}  # bucket index -> its parameters, in the bucket's order
        self._loose: dict[str, dict[str, torch.Tensor]] = {"error": {}, "p": {}, "q": {}}  # per parameter

    def send(self, bucket):
        s, idx = self.state, bucket.index()
        names = [self._name[id(p)] for p in bucket.parameters()]
        if self._names.get(idx) != names:
            self._repack(idx, names)
        before = s.total_numel_after_compression  # torch counts what each compressed call sends
        fut = self._hook(s, bucket)
        sent = s.total_numel_after_compression - before or bucket.buffer().numel()  # 0: a plain all-reduce
        return fut, sent * bucket.buffer().element_size()

    def _factors(self, names: list[str], shapes) -> list[tuple[str, int, int]]:
        """(name, P's length, Q's length) of the compressed gradients, in the order torch lays the
        factors out in a bucket: grouped by matrix shape, groups in order of first appearance."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, shape in zip(names, shapes):
            n = shape[0]
            m = math.prod(shape) // n
            r = min(n, m, self.state.matrix_approximation_rank)
            if self._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        return [f for group in groups.values() for f in group]

    def _unpack(self, idx: int) -> None:
        """Bucket ``idx``'s state into per-parameter pieces (``_loose``)."""
        s, names = self.state, self._names.pop(idx)
        error = s.error_dict.pop(idx, None)
        if error is not None:
            sizes = [self._sizes[n] for n in names]
            self._loose["error"].update(zip(names, error.split(sizes)))
        p, q = s.p_memory_dict.pop(idx, None), s.q_memory_dict.pop(idx, None)
        if p is not None and q is not None:
            factors = self._factors(names, [self._shapes[n] for n in names])
            self._loose["p"].update(zip([f[0] for f in factors], p.split([f[1] for f in factors])))
            self._loose["q"].update(zip([f[0] for f in factors], q.split([f[2] for f in factors])))

    def _repack(self, idx: int, names: list[str]) -> None:
        """Bucket ``idx``, now holding ``names``: its state from the pieces of every bucket that held them."""
        mine = set(names)
        for other in [i for i, ns in self._names.items() if i == idx or mine & set(ns)]:
            self._unpack(other)
        self._names[idx] = names
        s, loose = self.state, self._loose
        if not any(n in loose["error"] for n in names):
            return  # no state yet (warm-up): torch starts this bucket's
        err = [loose["error"].pop(n, None) for n in names]
        s.error_dict[idx] = torch.cat([e.to(self.device) if e is not None else torch.zeros(self._sizes[n], device=self.device)
                                       for e, n in zip(err, names)])
        factors = self._factors(names, [self._shapes[n] for n in names])
        ps, qs = [loose["p"].pop(f[0], None) for f in factors], [loose["q"].pop(f[0], None) for f in factors]
        if any(x is None for x in ps + qs):
            log.warning("PowerSGD: bucket %d's factors are not all known; torch draws them afresh", idx)
            return
        empty = torch.empty(0, device=self.device)
        s.p_memory_dict[idx] = torch.cat(ps).to(self.device) if ps else empty
        s.q_memory_dict[idx] = torch.cat(qs).to(self.device) if qs else empty

    def state_dict(self) -> dict[str, Any]:
        """Per parameter, in types ``torch.load(weights_only=True)`` accepts."""
        s = self.state
        for idx in list(self._names):
            self._unpack(idx)  # packed again, per bucket, at the next step
        _, key, pos, has_gauss, cached = s.rng.get_state()
        return {"iter": s.iter, "world_size": dist.get_world_size(),
                "rng": {"key": torch.from_numpy(key.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached": float(cached)},
                **{part: {n: t.detach().cpu().clone() for n, t in kept.items()} for part, kept in self._loose.items()}}

    def load_state_dict(self, saved: dict[str, Any] | None, *, step: int) -> None:
        """``saved``: this rank's state at ``step``, or None (a checkpoint without it: compression
        resumes where the step count says, with no error carried over)."""
        import numpy as np

        s = self.state
        if saved is None:
            s.iter = step
            return
        s.iter = int(saved["iter"])
        r = saved["rng"]
        s.rng.set_state(("MT19937", r["key"].numpy().astype(np.uint32), r["pos"], r["has_gauss"], r["cached"]))
        if saved["world_size"] != dist.get_world_size():
            log.warning("PowerSGD: the checkpoint's error feedback is of %d ranks, not %d; it starts at zero",
                        saved["world_size"], dist.get_world_size())
            return
        s.error_dict.clear(), s.p_memory_dict.clear(), s.q_memory_dict.clear()
        self._names.clear()
        self._loose = {part: dict(saved[part]) for part in ("error", "p", "q")}


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
            timer.last_collective_end = end = time.perf_counter()
            timer.record(start, end, nbytes, (n - 1) / n, blocking=True, dim="dp_shard")
            return None
        work.get_future().then(lambda f: timer.record(start, time.perf_counter(), nbytes, (n - 1) / n, dim="dp_shard"))
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


def hsdp_all_reduce_timer(timer: CommTimer, replicas: int):
    """An FSDP2 all-reduce hook (``set_all_reduce_hook``) that times HSDP's all-reduce of a unit's
    gradient shards across the replicas. FSDP2 calls the hook right after that all-reduce, which
    on gloo runs synchronously right after the unit's reduce-scatter (``TimedReduceScatter``
    stamps its end): the interval between the two is the all-reduce, all of it exposed. Logged as
    the ``dp_replicate`` dimension."""
    factor = 2 * (replicas - 1) / replicas

    def hook(reduce_output: torch.Tensor) -> None:
        nbytes = reduce_output.numel() * reduce_output.element_size()
        timer.record(timer.last_collective_end, time.perf_counter(), nbytes, factor, blocking=True,
                     dim="dp_replicate")

    return hook
