"""A real Airflow 3 on 127.0.0.1 for tests: api-server, scheduler, dag-processor, triggerer.

Each part is its own process with a throw-away AIRFLOW_HOME (SQLite metadata DB, LocalExecutor),
a free port and a known admin password; ``stop()`` ends every process group it started. The
client side is the scripts' (scripts/airflow_api.py: the official client on the public REST API
``/api/v2``, with a JWT from ``/auth/token``), exactly as a script or the web UI would talk to it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from scripts.airflow_api import AirflowAPI
from training.util import free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "test-" + secrets.token_urlsafe(9)


class LiveAirflow(AirflowAPI):
    def __init__(self, home: Path, *, extra_env: dict[str, str] | None = None):
        self.home = home
        self.port = free_port()
        # Every wait of the client first checks that no part of this Airflow died.
        super().__init__(f"http://127.0.0.1:{self.port}", "admin", PASSWORD, on_poll=self._check_alive)
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = self._make_env(extra_env or {})

    def _make_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            AIRFLOW_HOME=str(self.home),
            AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
            AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__EXECUTOR="LocalExecutor",
            AIRFLOW__CORE__PARALLELISM="4",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{self.home / 'airflow.db'}",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(self.home / "passwords.json"),
            AIRFLOW__API__BASE_URL=self.base,
            AIRFLOW__API__WORKERS="1",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"{self.base}/execution/",
            # Every part must sign and check the same JWTs; fixed per fixture, never a real secret.
            AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(32),
            AIRFLOW__API__SECRET_KEY=secrets.token_urlsafe(32),
            # Quick reaction instead of production pacing: the DAG folder is small.
            AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
            AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES="1",
            # The DAG files never change while the tests run: parsed once, not again every 30 s (each
            # parse imports Airflow and the plugins, 4 CPU seconds a minute on two cores for nothing).
            AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="3600",
            AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME="0.5",
            AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="True",
            # On a loaded 2-core machine the api-server can take longer than the default 5 s to
            # answer a task's first call; the task would fail before it starts.
            AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="60",
            MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
            AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
            # A task whose worker died stops heart-beating; notice it within a minute, not five.
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="40",
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="5",
        )
        env.update(extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "plugins"), str(ROOT), env.get("PYTHONPATH")]))
        return env

    # ------------------------------------------------------------------ processes
    def start(self, timeout: float = 300, *, triggerer: bool = True) -> "LiveAirflow":
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({"admin": PASSWORD}))
        airflow = str(Path(sys.executable).parent / "airflow")
        subprocess.run([airflow, "db", "migrate"], env=self.env, check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        parts = {
            "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(self.port)],
            "scheduler": ["scheduler", "--skip-serve-logs"],
            "dag-processor": ["dag-processor"],
            **({"triggerer": ["triggerer", "--skip-serve-logs"]} if triggerer else {}),
        }
        self._parts = parts
        for name in parts:
            self._start_part(name)
        deadline = time.monotonic() + timeout
        try:
            self.wait_until_up(timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; see {self.home}/api-server.log") from None
        # The execution API (what task processes call, not the public REST API) builds its versioned
        # models on first use; pay that once here rather than inside the first task's timeout.
        requests.get(f"{self.base}/execution/health", timeout=max(5.0, deadline - time.monotonic()))
        return self

    def _start_part(self, name: str) -> None:
        airflow = str(Path(sys.executable).parent / "airflow")
        log = open(self.home / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([airflow, *self._parts[name]], env=self.env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def restart(self, name: str) -> None:
        """Stop one part as a service manager does (SIGTERM to the part and everything it started,
        SIGKILL after 30 s), then start it again."""
        self._end([self.procs[name]])
        self._start_part(name)

    def _check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            logs = {n: (self.home / f"{n}.log").read_text()[-2000:] for n in dead}
            raise RuntimeError(f"Airflow parts exited: {dead}\n{logs}")

    @staticmethod
    def _end(procs: list[subprocess.Popen]) -> None:
        """SIGTERM to each process group, SIGKILL to those still there after 30 s."""
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stop(self) -> None:
        # The api-server last: a task still running when the scheduler stops reports its end
        # through it; without it the task retried for 30 s before being killed.
        self._end([p for n, p in self.procs.items() if n != "api-server"])
        self._end([p for n, p in self.procs.items() if n == "api-server"])
