"""The pods' launcher (training/distributed/elastic.py), for real: torchrun's agent with the c10d rendezvous
on 127.0.0.1 and gloo ranks, signalled as the kubelet signals a pod's main process. What it must
carry to the container's exit status: a preempted rank's 75 (torchrun alone exits 1), a rank's 2,
143 for a SIGTERM nothing could checkpoint, and a rendezvous failure named in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from training.distributed import elastic
from training.distributed.launch import torchrun_command
from training.train import EXIT_PREEMPTED, StepLog


def test_the_exit_codes_are_the_trainers():
    from training.cli import EXIT_BAD_INPUT

    assert (elastic.EXIT_PREEMPTED, elastic.EXIT_BAD_INPUT) == (EXIT_PREEMPTED, EXIT_BAD_INPUT) == (75, 2)


@pytest.mark.parametrize("codes, signalled, status", [
    ([75, 75], False, 75),
    ([75, -signal.SIGTERM], False, 75),  # the agent stopped the other rank once the first had exited
    ([75, -signal.SIGKILL], True, 75),
    ([2, 2], False, 2),
    ([75, 1], False, 1),  # one rank crashed: not a clean preemption
    ([75, 2], False, 1),
    ([1, -signal.SIGTERM], False, 1),
    ([], True, 143),  # SIGTERM before any rank ran
    ([-signal.SIGKILL, -signal.SIGKILL], True, 143),  # ranks outlived the shutdown timeout
    ([143, 143], True, 143),  # ranks outlived their own preemption grace
    ([143], False, 1),
    ([None, 75], True, 75),  # a rank that could not be reaped does not count
    ([0, 0], True, 0),  # the ranks had finished when SIGTERM came
])
def test_exit_status(codes, signalled, status):
    assert elastic.exit_status(codes, signalled=signalled) == status


def _launch(sets: dict, *, nnodes: str = "1:1", nproc: int = 2, rdzv_conf: str = "", port: int | None = None,
            env: dict | None = None, **kw) -> subprocess.Popen:
    train = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    options = ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    cmd = torchrun_command(train, nproc_per_node=nproc, nnodes=nnodes, rdzv_endpoint=f"127.0.0.1:{port or free_port()}",
                           rdzv_id="elastic-test", python=None, options=[*options, "--shutdown-timeout", "30"])
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    full_env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "training.distributed.elastic", *cmd[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=full_env, **kw)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _sets(dataset: Path, root: Path, **extra) -> dict:
    return {"dataset_uri": dataset, "checkpoint_dir": root / "ck", "output_dir": root / "out", "steps": 400,
            "batch_size": 32, "log_every": 5, "checkpoint_every": 100, **extra}


@pytest.mark.slow
def test_sigterm_to_the_agent_ends_in_a_checkpoint_and_exit_75(dataset, tmp_path):
    # 100 ms per all-reduce keeps the ranks far from the end when the signal lands.
    proc = _launch(_sets(dataset, tmp_path), env={"TRAINING_FAULT_COMM_DELAY_MS": "100"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not ((StepLog.last(tmp_path / "out") or {}).get("step", 0) >= 8):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what the kubelet (or `podman stop`) sends a container's main process
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    assert out.count("train: preempted; checkpoint written at step") == 2
    stopped = [p for p in (tmp_path / "ck").iterdir() if (p / "manifest.json").exists()]
    assert len(stopped) == 1 and 8 <= int(stopped[0].name[5:]) < 400
    # Both ranks exited by themselves after the checkpoint, within --shutdown-timeout (30 s): none
    # was left for the agent to kill (a rank that hung at exit showed up here as [-9, 75]).
    assert out.strip().splitlines()[-1].startswith("elastic: preempted: the ranks agreed on a step and wrote its "
                                                   "checkpoint (rank exit statuses [75, 75])"), out[-3000:]


@pytest.mark.slow
def test_sigterm_during_the_rendezvous_exits_143_at_once(dataset, tmp_path):
    port = free_port()
    proc = _launch(_sets(dataset, tmp_path), nnodes="2:2", nproc=1, rdzv_conf="join_timeout=120", port=port)
    # The agent hosts the rendezvous store once it is waiting for a second node that never comes
    # (a fixed sleep raced the imports on a loaded machine: the signal came before any handler).
    deadline = time.monotonic() + 120
    while not _listening(port):
        assert time.monotonic() < deadline and proc.poll() is None, "the agent never opened its rendezvous store"
        time.sleep(0.1)
    time.sleep(1)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert time.monotonic() - signalled < 10
    assert "elastic: stopped by SIGTERM before the ranks could checkpoint" in out


@pytest.mark.slow  # starts a Python process (tests/processes.py)
def test_bad_input_in_every_rank_exits_2(dataset, tmp_path):
    proc = _launch(_sets(dataset, tmp_path, lr=-1))
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out[-3000:]
    assert "config field 'lr'" in out and "elastic: bad input" in out


@pytest.mark.slow
def test_a_rendezvous_without_enough_nodes_fails_in_its_timeout_naming_it(dataset, tmp_path):
    start = time.monotonic()
    proc = _launch(_sets(dataset, tmp_path), nnodes="2:2", nproc=1, rdzv_conf="join_timeout=6")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("elastic: too few nodes joined the rendezvous store at 127.0.0.1:") and "join_timeout=6s" in last
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_store_nobody_hosts_fails_in_its_timeout_naming_the_endpoint(dataset, tmp_path):
    """A pod whose endpoint port is not the one pod 0 listens on (is_host=0 plays "another pod")."""
    port = free_port()
    proc = _launch(_sets(dataset, tmp_path), nnodes="2:2", nproc=1, rdzv_conf="read_timeout=5,is_host=0", port=port)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    last = out.strip().splitlines()[-1]
    assert f"elastic: cannot reach the rendezvous store at 127.0.0.1:{port}" in last and "read_timeout=5s" in last


@pytest.mark.slow
def test_a_port_that_answers_but_is_no_store_is_ended_by_the_watchdog(dataset, tmp_path):
    """Something else listens on the rendezvous port: torch's store client connects and waits for
    a reply without a limit. The watchdog ends it after the rendezvous timeouts, naming the port."""
    import socket

    port = free_port()
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen(16)
    try:
        start = time.monotonic()
        proc = _launch(_sets(dataset, tmp_path), nnodes="2:2", nproc=1, port=port,
                       rdzv_conf="read_timeout=3,join_timeout=3,last_call_timeout=1")
        out, _ = proc.communicate(timeout=120)
    finally:
        squatter.close()
    assert proc.returncode == 1
    last = out.strip().splitlines()[-1]
    assert f"the rendezvous with the rendezvous store at 127.0.0.1:{port}" in last and "within 17s" in last, last
    assert time.monotonic() - start < 60
