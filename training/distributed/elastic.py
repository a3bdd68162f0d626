"""``python -m training.distributed.elastic <torchrun arguments>``: torchrun (its parser, agent and
rendezvous) whose exit status keeps the trainer's exit-code contract (training/cli.py), for the
pods of the Kubernetes backend.

Exit status: 0 when the ranks finished; 75 or 2 when every rank that failed by itself exited with
that code (ranks the agent stopped do not count); on SIGTERM 75 if the ranks checkpointed, else 143
(at once before any rank started); 1 otherwise, as torchrun. A rendezvous that fails, or outlasts
its timeouts plus ``RDZV_SLACK_S``, ends with one line naming the cause, endpoint and timeout. The
last line starts with ``elastic:`` and says why it exits; it also goes to ``/dev/termination-log``.
Why not plain torchrun: docs/decisions/0007-elastic-launcher-keeps-exit-codes.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from training.distributed.launch import EXIT_BAD_INPUT, EXIT_PREEMPTED

EXIT_FAILED = 1
EXIT_SIGTERM = 128 + signal.SIGTERM
# Exit statuses of ranks the agent stopped itself (Popen reports a signal as its negative number).
STOPPED_BY_AGENT = {-signal.SIGTERM, -signal.SIGKILL}
TERMINATION_LOG = "/dev/termination-log"
RDZV_SLACK_S = 10  # beyond the rendezvous' own timeouts, before the watchdog ends a rendezvous


def exit_status(codes: Iterable[int | None], *, signalled: bool = False) -> int:
    """The container's exit status from the ranks' exit statuses (None: still running)."""
    codes = list(codes)
    if codes and all(c == 0 for c in codes):
        return 0  # the ranks had finished when the signal came
    own = {c for c in codes if c not in (0, None) and c not in STOPPED_BY_AGENT}
    if own in ({EXIT_PREEMPTED}, {EXIT_BAD_INPUT}):
        return own.pop()
    # A rank that outlived its own preemption grace exits 143 too (training/train.py).
    return EXIT_SIGTERM if signalled and own <= {EXIT_SIGTERM} else EXIT_FAILED


class RendezvousWatch:
    """Ends the process, naming the endpoint, when a rendezvous outlasts ``limit_s``. Armed from
    the start (the store is reached before the agent runs) and around each later rendezvous."""

    def __init__(self, limit_s: float, where: str) -> None:
        self.limit_s, self.where = limit_s, where
        self.since: float | None = time.monotonic()
        threading.Thread(target=self._watch, name="rendezvous-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            since = self.since
            if since is not None and time.monotonic() - since > self.limit_s:
                _say(f"the rendezvous with {self.where} did not complete within {self.limit_s:.0f}s: the port answered "
                     "but not as pod 0's c10d store (another process holds the rendezvous port on pod 0's node, or "
                     f"the connection goes elsewhere); check the rendezvous port; exit {EXIT_FAILED}")
                os._exit(EXIT_FAILED)


def _agent_class(watch: RendezvousWatch) -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        """torchrun's agent, remembering how its ranks last exited; its rendezvous watched."""

        exit_codes: dict[int, int | None] = {}

        def _rendezvous(self, worker_group: Any) -> None:
            watch.since = watch.since or time.monotonic()
            try:
                super()._rendezvous(worker_group)
            finally:
                watch.since = None

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                Agent.exit_codes = {r: f.exitcode for r, f in result.failures.items()}
            return result

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            super()._shutdown(death_sig, timeout)
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
            if handlers:
                Agent.exit_codes = {r: h.proc.returncode for r, h in handlers.items()}

    return Agent


def _rdzv_conf(args: Any) -> dict[str, int]:
    """The rendezvous timeouts in effect (torch's defaults where --rdzv-conf sets none)."""
    conf = {"read_timeout": 60, "join_timeout": 600, "last_call_timeout": 30}
    for kv in (args.rdzv_conf or "").split(","):
        key, _, value = kv.partition("=")
        if key in conf and value:
            conf[key] = int(value)
    return conf


def _where(args: Any) -> str:
    return f"the rendezvous store at {args.rdzv_endpoint} (run id {args.rdzv_id})"


def _rendezvous_cause(e: BaseException, args: Any) -> str | None:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    conf = _rdzv_conf(args)
    where = _where(args)
    if isinstance(e, RendezvousConnectionError):
        inner = f": {e.__cause__}" if e.__cause__ else ""
        return (f"cannot reach {where} within read_timeout={conf['read_timeout']}s{inner}. Pod 0 hosts "
                "it on the rendezvous port: check that every pod uses the same port, that pod 0 is running, and "
                "that no NetworkPolicy blocks the port between the pods")
    if isinstance(e, RendezvousTimeoutError):
        return (f"too few nodes joined {where} within join_timeout={conf['join_timeout']}s "
                f"(--nnodes {args.nnodes}): the other pods never reached it (not scheduled, image not pulled, "
                "or they cannot reach pod 0); read their status and logs")
    if isinstance(e, RendezvousClosedError):
        return f"{where} was closed: the job is ending (another node finished or gave up)"
    return None


def _say(message: str) -> None:
    line = f"elastic: {message}"
    print(line, file=sys.stderr, flush=True)
    try:
        with open(TERMINATION_LOG, "w", encoding="utf-8") as f:
            f.write(line[:4000])  # the kubelet keeps at most 4096 bytes
    except OSError:
        pass  # not in a Kubernetes pod


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    config, cmd, cmd_args = config_from_args(args)
    conf = _rdzv_conf(args)
    watch = RendezvousWatch(sum(conf.values()) + RDZV_SLACK_S, _where(args))
    agent = _agent_class(watch)
    api.LocalElasticAgent = agent  # launch_agent builds its agent from this module attribute
    agent.exit_codes = {}
    signal.signal(signal.SIGTERM, _terminate_process_handler)  # until torchrun installs its own
    signalled = False
    try:
        api.elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        return 0
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
    except SignalException as e:
        signalled = e.sigval == signal.SIGTERM
        codes = list(agent.exit_codes.values())
    except Exception as e:  # noqa: BLE001 - every other way the agent can end: name it, keep the contract
        cause = _rendezvous_cause(e, args)
        codes = list(agent.exit_codes.values())
        status = exit_status(codes)
        if status == EXIT_PREEMPTED:
            _say(f"the ranks were preempted and wrote a checkpoint; then {cause or e}; exit {status}")
        else:
            _say(f"{cause or f'{type(e).__name__}: {e}'}; exit {status}")
        return status
    status = exit_status(codes, signalled=signalled)
    what = {0: "the ranks had finished when the signal came",
            EXIT_PREEMPTED: "preempted: the ranks agreed on a step and wrote its checkpoint",
            EXIT_BAD_INPUT: "bad input: the ranks refused their configuration",
            EXIT_SIGTERM: "stopped by SIGTERM before the ranks could checkpoint"}.get(status, "a rank failed")
    _say(f"{what} (rank exit statuses {sorted(c for c in codes if c is not None)}); exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
