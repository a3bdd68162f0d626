"""MLflow's system metrics (CPU, memory, disk, network, GPU) for a run: sampled from its first
second on, and one last sample at the end of every attempt."""

from __future__ import annotations

import os

from training.log import logger


def start_system_metrics(run_id: str | None):
    """MLflow's own system-metrics sampler (CPU, memory, disk, network, GPU where present)
    attached to the existing run; ``resume_logging`` continues its step count after a restart.
    Returns the monitor (call ``finish()``) or None."""
    if not run_id:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=True)
        if not os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"):
            _ramp(monitor)
        monitor.start()
        return _SystemMetrics(monitor)
    except Exception as e:  # metrics about the machine must never stop training
        logger.warning(f"system metrics: not logged ({e})")
        return None


def _ramp(monitor, first_s: float = 1.0) -> None:
    """Sample after 1 s, then 2, 4, 8 s and from then on at MLflow's interval (10 s): a run of
    twenty seconds still gets several samples, a long one no more points than MLflow's default.
    The monitor's loop reads ``sampling_interval`` before every wait."""
    final, publish = monitor.sampling_interval, monitor.publish_metrics
    monitor.sampling_interval = min(first_s, final)

    def publish_then_slow_down(metrics):
        publish(metrics)
        monitor.sampling_interval = min(final, 2 * monitor.sampling_interval)

    monitor.publish_metrics = publish_then_slow_down


class _SystemMetrics:
    """MLflow's monitor publishes only when a sampling interval completes, so an attempt shorter
    than the interval (a quick retry, a restart near the end) would record nothing. ``finish``
    stops it and then publishes one last sample of the end of training."""

    def __init__(self, monitor) -> None:
        self.monitor = monitor

    def finish(self) -> None:
        m = self.monitor
        m.finish()  # joins the sampling thread and flushes what it queued
        try:
            m.collect_metrics()
            m.publish_metrics(m.aggregate_metrics())
            m.mlflow_logger.flush()
        except Exception as e:  # metrics about the machine must never stop training
            logger.warning(f"system metrics: last sample not logged ({e})")
