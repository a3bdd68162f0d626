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
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from training.distributed.comm import (CommTimer, PowerSGD, _fsdp_timed_comms, _timed, hsdp_all_reduce_timer,
                                      stock_sender)
from training.models import activations, compiling
from training.models.build import fsdp_layout, used_last
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


HOOKS = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
         "bf16": default_hooks.bf16_compress_hook}


def parallelize(model: nn.Module, cfg, info: DistInfo,
                initial: Callable[[nn.Module, torch.device], None] | None = None) -> tuple[nn.Module, CommTimer]:
    """Wrap ``model`` for ``cfg.strategy``; returns the wrapped model and its comm timer.
    ``initial``: gives a model built on the meta device its weights on ``info.device`` (a
    ``models.materialize.InitialWeights``): under fsdp after sharding, so each rank allocates and
    fills only its shards; under ddp before wrapping.

    ddp: DistributedDataParallel with bucketed all-reduce overlapped with backward, gradients as
    views into the buckets (no extra copy), and the chosen (timed) comm hook.
    fsdp: FSDP2 ``fully_shard`` on every unit from ``models.build.fsdp_layout`` (the model's
    ``fsdp_units``: transformer blocks, the built-ins' linear/conv layers, a user's list; else each
    direct child holding parameters; then a large embedding or head outside them) and then the root; with
    precision=bf16 parameters are all-gathered and computed in bf16, gradients reduced in fp32.
    """
    if initial is not None and cfg.strategy != "fsdp":
        initial(model, info.device)
    if not any(p.is_meta for p in model.parameters()):
        model = model.to(info.device)
    activations.apply(model, cfg.activation_checkpointing)  # before wrapping: FSDP2's hooks stay outside it
    compiling.apply(model, cfg.compile)  # after: the recomputed forward is what compiles; before sharding
    timer = CommTimer(info.device)
    if cfg.strategy == "ddp":
        wrapped = DDP(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        if cfg.comm_hook == "powersgd":
            wrapped.powersgd = PowerSGD(model, rank=cfg.powersgd_rank, warmup_steps=cfg.powersgd_warmup_steps,
                                        seed=cfg.seed, device=info.device)
            wrapped.register_comm_hook(timer, _timed(wrapped.powersgd.send))
        else:
            wrapped.register_comm_hook(timer, _timed(stock_sender(HOOKS[cfg.comm_hook])))
        _ddp_alive.add(wrapped)
        return wrapped, timer
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.precision == "bf16" else MixedPrecisionPolicy()
        mesh = data_parallel_mesh(cfg, info)
        units = fsdp_layout(model)
        held = {id(u) for u in used_last(model, units)}
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=id(unit) not in held)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        units.append(model)
        timer.timed = info.device.type == "cpu"  # see CommTimer: CUDA streams are not timed
        if timer.timed:
            all_gather, reduce_scatter = _fsdp_timed_comms(timer)
            replicas = mesh.size(0) if mesh.ndim == 2 else 1
            for unit in units:
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)
                if replicas > 1:
                    unit.set_all_reduce_hook(hsdp_all_reduce_timer(timer, replicas))
        if initial is not None:
            initial(model, info.device)
        return model, timer
    raise ValueError(f"unknown strategy {cfg.strategy!r}")


def rank_local_state(model: nn.Module) -> dict[str, Any]:
    """The parts of the wrapped model that hold state of this rank alone (checkpointed per rank,
    beside its RNG states): PowerSGD's error feedback."""
    psgd = getattr(model, "powersgd", None)
    return {"powersgd": psgd} if psgd is not None else {}


def data_parallel_mesh(cfg, info: DistInfo):
    """FSDP2's mesh: 1-D over every rank (plain FSDP), or 2-D ``(dp_replicate, dp_shard)`` for HSDP,
    each row a group of consecutive ranks (one node's, as torchrun numbers them) holding one sharded
    copy: parameters are all-gathered and gradients reduce-scattered within a row, and the shards'
    gradients all-reduced down each column, across the nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = cfg.mesh_shape(info.world_size)
    if replicate == 1:
        return init_device_mesh(info.device.type, (shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(info.device.type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


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
