"""The torchrun command line, built in one place for every launcher (local task, pods, bench, tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_command(train_args: list[str], *, nproc_per_node: int, nnodes: str = "1", max_restarts: int = 0,
                     master_port: int | None = None, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     python: str | None = sys.executable, options: Sequence[str] = ()) -> list[str]:
    """``torchrun ... -m training train <train_args>``.

    One machine (``master_port``): a static rendezvous on 127.0.0.1. Several machines or pods
    (``rdzv_endpoint``): the c10d rendezvous, ``nnodes`` as ``MIN:MAX``. ``python=None`` calls the
    ``torchrun`` script; otherwise ``python -m torch.distributed.run``. ``options``: further torchrun
    options of one launcher (the pods' shutdown and rendezvous timeouts)."""
    cmd = ["torchrun"] if python is None else [python, "-m", "torch.distributed.run"]
    if rdzv_endpoint is not None:
        cmd += ["--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id)]
    else:
        if master_port is None:
            raise ValueError("torchrun_command needs master_port (one machine) or rdzv_endpoint (several)")
        cmd += ["--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1",
                "--master-port", str(master_port)]
    return [*cmd, *options, "--max-restarts", str(max_restarts), "-m", "training", "train", *train_args]
