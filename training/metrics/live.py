"""Live metrics each rank serves to Prometheus while it trains (``LiveMetrics``): progress, speed,
loss, checkpoints, restarts, the heartbeat and memory, labelled with the experiment, the MLflow run,
the DAG run, the rank and the node; rank 0 adds the run-level view (global throughput, the slowest
rank, the spread between ranks). The hot path only stores floats in a dict; the text is built when
Prometheus scrapes, on prometheus_client's server thread. Names and meanings: ``METRICS`` (the table
in docs/operations.md is checked against it); the alert rules: deploy/prometheus/training-alerts.yaml.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections import deque
from typing import Any

from training.log import logger
from training.metrics.preflight import rss

# What the launchers hand the ranks for the labels (the MLflow run id travels as MLFLOW_RUN_ID).
EXPERIMENT_ENV = "TRAINING_EXPERIMENT"
DAG_RUN_ENV = "TRAINING_DAG_RUN_ID"
NODE_ENV = "NODE_NAME"  # the pods: the node's name (downward API); elsewhere the host name
LABELS = ("experiment", "mlflow_run_id", "dag_run_id", "rank", "node")
STALL_FACTOR = 10.0  # "stalled": no step for this many typical steps (and at least stall_after_s)
TYPICAL_WINDOWS = 50  # the typical step time is the median over this many recent log windows

# name -> help. Per rank unless the name starts with training_run_ (rank 0 only).
METRICS: dict[str, str] = {
    "training_step": "last completed optimizer step",
    "training_last_step_timestamp_seconds": "Unix time the last step completed",
    "training_seconds_since_last_step": "the heartbeat: seconds since this rank's last completed step (at scrape time)",
    "training_step_seconds": "wall time of this rank's last step",
    "training_typical_step_seconds": "median over recent log windows of wall seconds per step (evaluation and "
                                     "checkpoints included)",
    "training_stall_threshold_seconds": "seconds without a step after which the run counts as stalled: "
                                        "max(stall_after_s, 10 x typical step)",
    "training_samples_per_second": "samples this rank trained per second over the last log window",
    "training_tokens_per_second": "tokens this rank trained per second over the last log window (token models)",
    "training_compute_seconds": "this rank's step time less exposed communication and data wait, last window mean",
    "training_data_wait_seconds": "seconds per step waiting for the batch, last window mean",
    "training_comm_seconds": "seconds per step inside collectives, last window mean (CPU clocks; absent on CUDA)",
    "training_comm_exposed_fraction": "share of the step time spent waiting on communication, last window",
    "training_loss": "this rank's mean training loss over the last log window",
    "training_grad_norm": "global gradient norm at the last log step",
    "training_learning_rate": "learning rate at the last log step",
    "training_loss_scale": "fp16 grad scaler's loss scale (fp16 only)",
    "training_last_checkpoint_step": "step of the newest checkpoint committed (or resumed from); 0: none yet",
    "training_last_checkpoint_timestamp_seconds": "Unix time of that commit (the attempt's start when none yet)",
    "training_seconds_since_checkpoint": "seconds since the newest committed checkpoint (at scrape time)",
    "training_checkpoint_every_steps": "checkpoint_every of the run (0: no periodic checkpoints)",
    "training_restarts": "restarts of the run so far (torchrun's restart count)",
    "training_memory_rss_bytes": "resident set size of the rank's process",
    "training_cuda_allocated_bytes": "CUDA memory allocated by tensors (GPU ranks only)",
    "training_run_samples_per_second": "rank 0: global samples per second of the run (the global batch over the ranks' mean step time)",
    "training_run_tokens_per_second": "rank 0: global tokens per second (token models)",
    "training_run_step_seconds_max": "rank 0: the slowest rank's wall seconds per step, last window",
    "training_run_compute_seconds_max": "rank 0: the largest per-rank compute seconds per step, last window",
    "training_run_compute_seconds_median": "rank 0: the median over ranks of compute seconds per step",
    "training_run_straggler_ratio": "rank 0: max / median compute seconds per step over ranks (1 = even)",
    "training_run_slowest_rank": "rank 0: the rank with the largest compute seconds per step",
    "training_run_loss": "rank 0: mean training loss over ranks, last window",
}


def labels(rank: int) -> dict[str, str]:
    return {"experiment": os.environ.get(EXPERIMENT_ENV, ""), "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID", ""),
            "dag_run_id": os.environ.get(DAG_RUN_ENV, ""), "rank": str(rank),
            "node": os.environ.get(NODE_ENV) or socket.gethostname()}


class LiveMetrics:
    """One rank's metrics and, once ``serve`` ran, its HTTP endpoint. Methods are called by the
    recorder and the checkpointer; they only store numbers. ``collect`` is prometheus_client's
    custom-collector hook, run on its server thread at each scrape."""

    def __init__(self, rank: int, *, checkpoint_every: int, restarts: int, stall_after_s: float,
                 cuda: bool = False) -> None:
        self.label_values = labels(rank)
        self.stall_after_s, self.cuda = stall_after_s, cuda
        now = time.time()
        self.values: dict[str, float] = {"training_checkpoint_every_steps": float(checkpoint_every),
                                         "training_restarts": float(restarts),
                                         "training_last_step_timestamp_seconds": now,
                                         "training_last_checkpoint_step": 0.0,
                                         "training_last_checkpoint_timestamp_seconds": now,
                                         "training_stall_threshold_seconds": stall_after_s}
        self._windows: deque[float] = deque(maxlen=TYPICAL_WINDOWS)
        self.server = None
        self.port: int | None = None  # where the metrics are served

    # ------------------------------------------------------------------ fed by the trainer

    def started(self, step: int, resumed: bool) -> None:
        self.values["training_step"] = float(step)
        if resumed:
            self.values["training_last_checkpoint_step"] = float(step)

    def step(self, step: int, seconds: float) -> None:
        """Every step: two stores, no lock (a scrape reading the older value is harmless)."""
        v = self.values
        v["training_step"] = step
        v["training_step_seconds"] = seconds
        v["training_last_step_timestamp_seconds"] = time.time()

    def checkpoint_committed(self, step: int) -> None:
        self.values["training_last_checkpoint_step"] = float(step)
        self.values["training_last_checkpoint_timestamp_seconds"] = time.time()

    def window(self, mine: dict[str, float], stats: dict[str, float], wall_per_step: float) -> None:
        """At a log window's end: this rank's figures (``mine``) and the window's (``stats``, the
        recorder's). ``wall_per_step``: the window's wall seconds per step, everything included."""
        self._windows.append(wall_per_step)
        typical = statistics.median(self._windows)
        new = {**mine, "training_typical_step_seconds": typical,
               "training_stall_threshold_seconds": max(self.stall_after_s, STALL_FACTOR * typical)}
        for key, name in (("train/grad_norm", "training_grad_norm"), ("train/lr", "training_learning_rate"),
                          ("train/loss_scale", "training_loss_scale"), ("comm/exposed_fraction",
                                                                        "training_comm_exposed_fraction")):
            if key in stats:
                new[name] = stats[key]
        self.values.update(new)

    def run_view(self, figures: dict[str, float]) -> None:
        """Rank 0: the run-level figures from the window's all-gather."""
        self.values.update(figures)

    # ------------------------------------------------------------------ served

    def serve(self, host: str, port: int) -> bool:
        """Serve on ``host:port``. A port another process holds (another run on this machine): a
        free port instead, named in a warning; an address that cannot be served costs the metrics,
        never the run (a warning). ``self.port``: where it serves (None: nowhere)."""
        import errno

        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            try:
                self.server, _ = start_http_server(port, addr=host, registry=registry)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                self.server, _ = start_http_server(0, addr=host, registry=registry)
                logger.warning(f"metrics: {host}:{port} is taken by another process; rank {self.label_values['rank']} "
                               f"serves on port {self.server.server_port} instead (give each run on one machine its "
                               "own metrics_port so Prometheus finds it)")
        except OSError as e:
            logger.warning(f"metrics: cannot serve on {host}:{port} ({e}): rank {self.label_values['rank']} "
                           "serves no Prometheus metrics (set metrics_host to this machine's address, or "
                           "metrics_port=0 for none)")
            return False
        self.port = self.server.server_port
        logger.info(f"metrics: Prometheus metrics on http://{host}:{self.port}/metrics")
        return True

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        values = dict(self.values)  # a copy: the training thread keeps writing
        now = time.time()
        values["training_seconds_since_last_step"] = now - values["training_last_step_timestamp_seconds"]
        values["training_seconds_since_checkpoint"] = now - values["training_last_checkpoint_timestamp_seconds"]
        resident = rss(os.getpid())  # 0: not Linux
        if resident:
            values["training_memory_rss_bytes"] = float(resident)
        if self.cuda:
            import torch

            values["training_cuda_allocated_bytes"] = float(torch.cuda.memory_allocated())
        names, label_values = list(self.label_values), list(self.label_values.values())
        for name, help_ in METRICS.items():
            if name in values:
                family = GaugeMetricFamily(name, help_, labels=names)
                family.add_metric(label_values, float(values[name]))
                yield family
