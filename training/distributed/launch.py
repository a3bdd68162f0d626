"""The torchrun command line, built in one place for every launcher (the local Airflow task, the
Kubernetes pods, the benchmark sweep, tests and benchmarks), and the exit codes launchers read:
0 done, 2 bad input (fix it, do not retry), 75 preempted (a checkpoint of the current step was
written: run again to resume), 1 anything else (a retry may help)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

TRAIN = ("-m", "training", "train")
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 75


def torchrun_command(train_args: list[str], *, nproc_per_node: int, nnodes: str = "1", max_restarts: int = 0,
                     master_port: int | None = None, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     python: str | None = sys.executable, entry: Sequence[str] = TRAIN,
                     options: Sequence[str] = ()) -> list[str]:
    """``torchrun ... --max-restarts K -m training train <train_args>``.

    One machine (``master_port``): a static rendezvous on 127.0.0.1. Several machines or pods
    (``rdzv_endpoint``): the c10d rendezvous, ``nnodes`` as ``MIN:MAX``, ``rdzv_id`` naming the
    job. ``python=None`` calls the ``torchrun`` script; otherwise ``python -m torch.distributed.run``.
    ``entry`` replaces ``-m training train`` for a program that is not the trainer (the bare loop
    of benchmarks/overhead_bench.py). ``options``: further torchrun options of one launcher (the
    pods' shutdown and rendezvous timeouts)."""
    cmd = ["torchrun"] if python is None else [python, "-m", "torch.distributed.run"]
    cmd += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    if rdzv_endpoint is not None:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id)]
    elif master_port is not None:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    else:
        raise ValueError("torchrun_command needs master_port (one machine) or rdzv_endpoint (several)")
    return [*cmd, *options, "--max-restarts", str(max_restarts), *entry, *train_args]
