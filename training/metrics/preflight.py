"""The memory preflight: each rank's share of the machine's memory (``Budget``: the cgroup limit
of the process, v1 or v2, else MemAvailable; less what others already use; split between the
ranks of the machine) against the estimate (training/metrics/memory.py). ``check`` refuses a run
that cannot fit with a ``ConfigError`` naming the estimate, the budget and the changes whose
estimate fits. It runs on the Airflow worker before launch and in every rank before its process
group starts (exit code 2).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from training.config.fields import ConfigError
from training.metrics.memory import AGENT_CPU, Estimate, gib

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True)
class Budget:
    """What one rank may use: ``(limit - used by others) / ranks``."""

    per_rank: int
    limit: int
    used_by_others: int
    ranks: int
    source: str

    def describe(self) -> str:
        return (f"{gib(self.per_rank)} per rank ({self.source} {gib(self.limit)}, {gib(self.used_by_others)} in use by "
                f"other processes, {self.ranks} rank{'s' if self.ranks != 1 else ''})")


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return None if raw == "max" else int(raw)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> tuple[int, int, str] | None:
    """(limit, working set, where) of this process's memory cgroup, the tightest limit on its
    path; the working set as the kubelet counts it (usage less inactive file cache). None: no limit."""
    found: list[tuple[int, int, str]] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        elif controllers == "":  # v2 (alone, or the unified hierarchy of a hybrid layout)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            files = ("memory.max", "memory.current", "inactive_file")
        else:
            continue
        parts = Path(path.lstrip("/")).parts
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            limit = _read_int(folder / files[0])
            usage = _read_int(folder / files[1])
            if limit is None or usage is None or limit >= NO_LIMIT:
                continue
            working = max(0, usage - _stat(folder / "memory.stat", files[2]))
            found.append((limit, working, f"cgroup {'v1' if files[0].endswith('bytes') else 'v2'} {folder}"))
    return min(found, default=None)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sibling_ranks() -> list[int]:
    """This rank and the other ranks torchrun's agent (the parent) started on this machine."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return [os.getpid()]
    ppid = os.getppid()
    try:
        children = [int(p) for p in Path(f"/proc/{ppid}/task/{ppid}/children").read_text().split()]
    except OSError:
        children = []
    return sorted(set(children) | {os.getpid()})


def local_budget(ranks: int, *, ranks_started: list[int] | None = None, agent: int = 0) -> Budget:
    """The host memory of this machine per rank. ``ranks_started``: the processes of the ranks
    themselves (their resident set is theirs, not others'); ``agent``: a torchrun agent still to start."""
    ours = sum(rss(p) for p in ranks_started or [])
    cg = cgroup_memory()
    if cg is not None:
        limit, working, where = cg
        others = max(0, working - ours) + agent
        return Budget(per_rank=max(0, limit - others) // ranks, limit=limit, used_by_others=others, ranks=ranks,
                      source=f"the memory limit of {where}")
    total = mem_available() + ours
    return Budget(per_rank=max(0, total - agent) // ranks, limit=total, used_by_others=agent, ranks=ranks,
                  source="MemAvailable (no cgroup limit)")


def pod_budget(limit: int, ranks: int, *, field_name: str = "k8s_memory_limit") -> Budget:
    """A pod's memory limit split between its ranks, less the torchrun agent."""
    return Budget(per_rank=max(0, limit - AGENT_CPU) // ranks, limit=limit, used_by_others=AGENT_CPU, ranks=ranks,
                  source=f"the pod memory limit {field_name}")


def cuda_budget(device) -> Budget:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return Budget(per_rank=int(free), limit=int(total), used_by_others=int(total - free), ranks=1,
                  source=f"the free memory of {torch.cuda.get_device_name(device)}")


# --------------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Change:
    """A change of the config a refusal proposes: the fields set, and the world size it runs on."""

    label: str
    values: dict
    world_size: int


def changes(cfg, world_size: int, *, has_blocks: bool) -> list[Change]:
    """What a user can change, cheapest in compute first."""
    out: list[Change] = []
    ac = ["full"] if has_blocks and cfg.activation_checkpointing != "full" else []
    if cfg.strategy == "ddp" and world_size > 1:
        out.append(Change("strategy=fsdp", {"strategy": "fsdp", "comm_hook": "none",
                                            **({"precision": "bf16"} if cfg.precision == "fp16" else {})}, world_size))
    if cfg.strategy == "fsdp" and cfg.dp_replicate != 1 and world_size > 1:  # HSDP: shard over every rank
        out.append(Change("dp_replicate=1 (fsdp over every rank)", {"dp_replicate": 1, "dp_shard": -1}, world_size))
    for mode in ac:
        out.append(Change(f"activation_checkpointing={mode}", {"activation_checkpointing": mode}, world_size))
        if cfg.strategy == "ddp" and world_size > 1:
            out.append(Change(f"strategy=fsdp and activation_checkpointing={mode}",
                              {"strategy": "fsdp", "comm_hook": "none", "activation_checkpointing": mode}, world_size))
    unit = world_size * cfg.grad_accum
    for div in (2, 4):
        smaller = cfg.batch_size // div
        if smaller >= unit and smaller % unit == 0:
            out.append(Change(f"batch_size={smaller}", {"batch_size": smaller}, world_size))
    for mult in (2, 4):
        bigger = world_size * mult
        if cfg.batch_size % (bigger * cfg.grad_accum) == 0:
            out.append(Change(f"strategy=fsdp on {bigger} ranks, each with this budget (world_size / nodes)",
                              {"strategy": "fsdp", "comm_hook": "none", "dp_replicate": 1, "dp_shard": -1}, bigger))
    return out


def check(est: Estimate, budget: Budget, cfg, world_size: int, *, estimate_for: Callable[[object, int], Estimate],
          has_blocks: bool = True, where: str = "") -> None:
    """Refuse (``ConfigError``) when ``est`` does not fit ``budget``, naming the changes whose
    estimate fits (``estimate_for(changed_cfg, world_size)``)."""
    if est.total <= budget.per_rank:
        return
    fitting: list[str] = []
    for change in changes(cfg, world_size, has_blocks=has_blocks):
        try:
            other = estimate_for(dataclasses.replace(cfg, **change.values), change.world_size)
        except Exception:  # noqa: BLE001 - an alternative that cannot be estimated is not proposed
            continue
        if other.total <= budget.per_rank:
            fitting.append(f"{change.label} (estimate {gib(other.total)})")
        if len(fitting) == 3:
            break
    field_name = next((c.label.split("=")[0] for c in changes(cfg, world_size, has_blocks=has_blocks)
                       if any(f.startswith(c.label) for f in fitting[:1])), "strategy")
    proposal = ("these fit: " + "; ".join(fitting)) if fitting else "no single change found fits"
    raise ConfigError(
        field_name,
        f"each rank's estimated peak memory {est.line()} is more than its budget {budget.describe()}"
        + (f" {where}" if where else ""),
        f"{proposal}. Levers: strategy=fsdp (parameters, gradients and AdamW state split over the ranks), more "
        "world_size / nodes with fsdp, activation_checkpointing=full (blocks recomputed in backward), a smaller "
        "batch_size (or grad_accum with the same batch_size)")


def has_blocks(cfg) -> bool:
    """Whether activation checkpointing can be proposed (the built-ins mlp and cnn have no blocks)."""
    return cfg.model not in ("mlp", "cnn")


def preflight_rank(cfg, spec, train, world_size: int) -> Estimate:
    """In a rank, before its process group: the estimate against this machine's memory per local
    rank (a GPU's free memory on CUDA). Raises ``ConfigError`` (exit 2) when it cannot fit."""
    import torch

    from training.metrics.memory import estimate_run

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def estimate_for(c, ws: int) -> Estimate:
        return estimate_run(c, spec, train, world_size=ws, device=device)

    est = estimate_for(cfg, world_size)
    if device == "cuda":
        budget = cuda_budget(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    else:
        budget = local_budget(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), ranks_started=sibling_ranks())
    check(est, budget, cfg, world_size, estimate_for=estimate_for, has_blocks=has_blocks(cfg))
    return est
