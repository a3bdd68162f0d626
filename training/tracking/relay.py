"""Which MLflow logger a rank gets (``logger_for``), and the relay: with
``TRAINING_MLFLOW_RELAY=stdout`` rank 0's ``RelayLogger`` writes each call as one
``@@mlflow {json}`` line on stdout and the launching task's ``RelayReceiver`` applies it to the
run, so the ranks never import MLflow nor open a second connection to the store.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from training.tracking.run import NullLogger, OnceLogger, RunLogger
from training.tracking.system import start_system_metrics


RELAY_ENV = "TRAINING_MLFLOW_RELAY"


RELAY_PREFIX = "@@mlflow "


_LINE_BYTES = 3500  # below PIPE_BUF (4096): one write() per line, never interleaved with another rank's


class RelayLogger:
    """Rank 0's logger when the launcher relays (``TRAINING_MLFLOW_RELAY=stdout``): every public
    ``RunLogger`` method, called here, becomes one ``@@mlflow {"call": name, "args": [...],
    "kwargs": {...}}`` line on stdout, which ``RelayReceiver`` replays on its ``RunLogger`` (so a
    method added to ``RunLogger`` is relayed without a change here). Metrics logged through
    ``run.OnceLogger`` are sent as ``log_metrics_once``: the receiving end, which can read the
    run, skips steps the run already has. ``run_id`` stays None: the launcher samples the system
    metrics. Calls whose one argument is a mapping of independent keys (params, tags, metrics) are
    split so that every line stays under PIPE_BUF and is written by one ``write()``."""

    run_id = None
    skips_logged_steps = True
    SPLITTABLE = ("log_params", "set_tags", "log_metrics", "log_metrics_once")

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "finish" or not callable(getattr(RunLogger, name, None)):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._relay(name, args, kwargs)

    def log_metrics_once(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        self._relay("log_metrics_once", (metrics,), {"step": step})
        return metrics

    def finish(self, status: str = "FINISHED") -> None:  # the task owns the run's status
        ...

    def _relay(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        if name in self.SPLITTABLE and len(args) == 1 and isinstance(args[0], dict):
            for chunk in _chunks(args[0]):
                self._send(name, (chunk,), kwargs)
        else:
            self._send(name, args, kwargs)

    @staticmethod
    def _send(name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        line = json.dumps({"call": name, "args": list(args), "kwargs": kwargs}, separators=(",", ":"), default=str)
        sys.stdout.flush()  # keep the order with the progress lines printed before
        os.write(1, (RELAY_PREFIX + line + "\n").encode())


def _chunks(items: dict[str, Any]):
    """``items`` in pieces whose JSON stays under ``_LINE_BYTES`` (one item alone may exceed it)."""
    chunk: dict[str, Any] = {}
    for k, v in items.items():
        if chunk and len(json.dumps({**chunk, k: v}, default=str)) > _LINE_BYTES:
            yield chunk
            chunk = {}
        chunk[k] = v
    if chunk:
        yield chunk


class RelayReceiver:
    """The launcher's end of ``RelayLogger``: ``handle(line)`` replays a relayed call on the run
    (and says it did), other lines are the caller's. ``log_metrics_once`` goes through
    ``run.OnceLogger``, which reads the run's logged steps once per metric (an earlier task
    try's too) and skips the steps a restarted rank group replays. Samples the system metrics
    while it is open."""

    def __init__(self, run_id: str, *, system_metrics: bool = True) -> None:
        self.logger = RunLogger(run_id)
        self.once = OnceLogger(self.logger)
        self.system_metrics = start_system_metrics(run_id) if system_metrics else None

    def handle(self, line: str) -> bool:
        if not line.startswith(RELAY_PREFIX):
            return False
        msg = json.loads(line[len(RELAY_PREFIX):])
        name = msg["call"]
        if name.startswith("_") or name == "finish" or not callable(getattr(RunLogger, name, None)):
            raise ValueError(f"rank 0 relayed {name!r}, which is no RunLogger logging method")
        if name == "log_metrics_once":
            self.once.log_metrics(*msg["args"], **msg["kwargs"])
        else:
            getattr(self.logger, name)(*msg["args"], **msg["kwargs"])
        return True

    def close(self) -> None:
        if self.system_metrics is not None:
            self.system_metrics.finish()
            self.system_metrics = None


def logger_for(is_main: bool) -> RunLogger | RelayLogger | NullLogger:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not (is_main and run_id):
        return NullLogger()
    return RelayLogger() if os.environ.get(RELAY_ENV) == "stdout" else RunLogger(run_id)
