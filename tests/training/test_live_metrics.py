"""Live metrics with the real parts: Debian's Prometheus server on 127.0.0.1, with the repository's
alert rules, scrapes a real 2-rank torchrun run. The series carry their labels, rank 0 alone serves
the run-level view; SIGSTOP of one rank fires TrainingStalled once the stall threshold has passed,
and SIGCONT resolves it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
from training.distributed.launch import torchrun_command
from training.tracking.relay import RELAY_ENV
from training.metrics.live import DAG_RUN_ENV, EXPERIMENT_ENV, LiveMetrics
from training.util import free_port

RULES = ROOT / "deploy" / "prometheus" / "training-alerts.yaml"
STALL_AFTER_S = 3.0  # the threshold's floor: short for the test; the typical step decides above it


def _two_free_ports() -> int:
    """A base port p with p and p + 1 free (rank 0 and rank 1 serve on base + local rank)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Prom:
    """A real Prometheus server with a temporary config, storage and the repository's rules."""

    def __init__(self, folder: Path, targets: list[str]) -> None:
        self.port = free_port()
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "training", "static_configs": [{"targets": targets}]}]}))
        self.proc = subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={config}",
                                      f"--storage.tsdb.path={folder / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "w"))
        _until("Prometheus ready", self.ready, 120)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            assert self.proc.poll() is None, "prometheus exited"
            return False

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        return _get(url)["data"]["result"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in _get(f"http://127.0.0.1:{self.port}/api/v1/alerts")["data"]["alerts"]
                if a["labels"]["alertname"] == name]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _until(what: str, check, timeout: float, launcher: subprocess.Popen | None = None, out: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if launcher is not None and launcher.poll() is not None:
            raise AssertionError(f"torchrun exited {launcher.returncode}: {out.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f}s: {what}" + (f"; torchrun: {out.read_text()[-3000:]}" if out else ""))


def _rank_process(launcher: subprocess.Popen, local_rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == str(local_rank) and "training" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no rank with LOCAL_RANK={local_rank} under torchrun")


@pytest.mark.slow
def test_prometheus_scrapes_two_ranks_and_the_stall_alert_fires_and_resolves(dataset, tmp_path):
    assert shutil.which("prometheus"), "prometheus is missing: `make prometheus` installs Debian's package"
    run_id = uuid.uuid4().hex  # rank 0 relays its MLflow calls on stdout, as under the local backend
    base = _two_free_ports()
    sets = [f"dataset_uri={dataset}", f"checkpoint_dir={tmp_path / 'ck'}", "steps=1000000", "batch_size=32",
            "log_every=10", "checkpoint_every=0", f"metrics_port={base}", f"stall_after_s={STALL_AFTER_S}",
            "collective_timeout_s=600"]
    cmd = torchrun_command([a for s in sets for a in ("--set", s)], nproc_per_node=2, master_port=free_port())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MLFLOW_RUN_ID": run_id, RELAY_ENV: "stdout",
           EXPERIMENT_ENV: "live_metrics_test", DAG_RUN_ENV: "manual__live"}
    out = tmp_path / "torchrun.log"  # a file, not a pipe nobody drains: a full pipe would stall rank 0 itself
    launcher = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    prom = Prom(tmp_path, [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])  # starts while the ranks start
    stopped = None
    try:
        # Both ranks scraped, with their labels; run-level figures from rank 0 alone.
        def both_ranks():
            found = prom.query("training_loss")
            return found if len(found) == 2 else None

        series = _until("both ranks' training_loss in Prometheus", both_ranks, 240, launcher, out)
        assert {s["metric"]["rank"] for s in series} == {"0", "1"}
        for s in series:
            labels = s["metric"]
            assert (labels["experiment"], labels["mlflow_run_id"], labels["dag_run_id"]) == \
                ("live_metrics_test", run_id, "manual__live")
            assert labels["node"] and labels["job"] == "training"
        run_view = prom.query("training_run_samples_per_second")
        assert [s["metric"]["rank"] for s in run_view] == ["0"] and float(run_view[0]["value"][1]) > 0
        assert len(prom.query("training_seconds_since_last_step < training_stall_threshold_seconds")) == 2
        assert not prom.alerts("TrainingStalled")

        # SIGSTOP rank 1: rank 0 waits in the next collective, its heartbeat ages past the threshold.
        threshold = float(prom.query('training_stall_threshold_seconds{rank="0"}')[0]["value"][1])
        stopped = _rank_process(launcher, 1)
        stopped.suspend()
        t_stop = time.time()
        firing = _until("TrainingStalled firing", lambda: [a for a in prom.alerts("TrainingStalled")
                                                            if a["state"] == "firing"], threshold + 60, launcher, out)
        fired_after = time.time() - t_stop
        alert = firing[0]
        assert alert["labels"]["mlflow_run_id"] == run_id and alert["labels"]["severity"] == "page"
        assert "runbook" in alert["annotations"]
        # Not before the threshold: the alert became active once the heartbeat was older than it.
        from datetime import datetime

        active_at = datetime.fromisoformat(alert["activeAt"].replace("Z", "+00:00")).timestamp()
        assert active_at >= t_stop + threshold - 1.5, (active_at - t_stop, threshold)
        assert prom.query(f'up{{instance="127.0.0.1:{base + 1}"}} == 0'), "the stopped rank cannot answer a scrape"
        print(f"stall threshold {threshold:.1f}s; TrainingStalled firing {fired_after:.1f}s after SIGSTOP")

        # SIGCONT: steps resume and the alert resolves.
        step_before = float(prom.query('training_step{rank="0"}')[0]["value"][1])
        stopped.resume()
        stopped = None
        _until("TrainingStalled resolved", lambda: not prom.alerts("TrainingStalled"), 60, launcher, out)
        assert float(prom.query('training_step{rank="0"}')[0]["value"][1]) > step_before
    finally:
        if stopped is not None:
            stopped.resume()
        # torchrun starts each rank in a session of its own: the ranks are killed by pid, then the agent.
        try:
            ranks = psutil.Process(launcher.pid).children(recursive=True)
        except psutil.Error:
            ranks = []
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.kill()
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        prom.stop()


def test_a_port_in_use_moves_the_metrics_and_a_bad_address_costs_them_not_the_run(caplog):
    """Another process on the port: the rank serves on a free port and names it; an address it
    cannot serve on: the rank warns and trains on without metrics."""
    logging.getLogger("training").addHandler(caplog.handler)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        moved = LiveMetrics(0, checkpoint_every=0, restarts=0, stall_after_s=300)
        assert moved.serve("127.0.0.1", busy)
    try:
        assert moved.port != busy and f"serves on port {moved.port} instead" in caplog.text
        with urllib.request.urlopen(f"http://127.0.0.1:{moved.port}/metrics", timeout=10) as r:
            assert "training_memory_rss_bytes{" in r.read().decode()
    finally:
        moved.close()
    nowhere = LiveMetrics(0, checkpoint_every=0, restarts=0, stall_after_s=300)
    assert not nowhere.serve("192.0.2.1", free_port())  # an address this machine does not have
    logging.getLogger("training").removeHandler(caplog.handler)
    assert "serves no Prometheus metrics" in caplog.text and nowhere.port is None
    free = LiveMetrics(0, checkpoint_every=5, restarts=1, stall_after_s=300)
    port = free_port()
    assert free.serve("127.0.0.1", port)
    try:
        free.step(7, 0.25)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'training_step{' in text and 'rank="0"' in text and "training_restarts{" in text
        assert "training_loss{" not in text  # no window closed yet: no figure rather than a made-up one
    finally:
        free.close()
