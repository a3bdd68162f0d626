"""The one torchrun command builder, read back with torchrun's own argument parser."""

import sys

import pytest
from torch.distributed.run import get_args_parser

from training.distributed.launch import torchrun_command


def _parsed(cmd: list[str]):
    head = 1 if cmd[0] == "torchrun" else 3
    return get_args_parser().parse_args(cmd[head:])


def test_one_machine_runs_the_trainer_with_a_static_rendezvous():
    cmd = torchrun_command(["--config", "cfg.json"], nproc_per_node=2, master_port=29511, max_restarts=1)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    a = _parsed(cmd)
    assert (a.nnodes, a.nproc_per_node, a.master_addr, a.master_port, a.max_restarts) == ("1", "2", "127.0.0.1", 29511, 1)
    assert (a.module, a.training_script, a.training_script_args) == (True, "training", ["train", "--config", "cfg.json"])


def test_pods_use_the_c10d_rendezvous_and_the_torchrun_script():
    cmd = torchrun_command(["--set", "steps=10"], nproc_per_node=1, nnodes="2:4", rdzv_endpoint="job-0.svc:29400",
                           rdzv_id="job", python=None)
    assert cmd[0] == "torchrun"
    a = _parsed(cmd)
    assert (a.nnodes, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id, a.max_restarts) == ("2:4", "c10d", "job-0.svc:29400", "job", 0)
    assert a.training_script_args == ["train", "--set", "steps=10"]


def test_a_rendezvous_is_required():
    with pytest.raises(ValueError):
        torchrun_command([], nproc_per_node=1)
