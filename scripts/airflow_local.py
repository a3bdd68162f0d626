"""`make airflow-up` / `make airflow-down`: the Airflow 3 parts on this machine, bound to 127.0.0.1.

Starts api-server (web UI + REST on 127.0.0.1:8080), scheduler, dag-processor and triggerer as
background processes with a project-local AIRFLOW_HOME (.airflow/, SQLite). `airflow standalone`
is not used because it binds 0.0.0.0. The admin password is generated once, kept in
.airflow/passwords.json (not committed) and printed.
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

import project_env

project_env.apply()  # AIRFLOW_HOME, the DAG and plugin folders, PYTHONPATH: this checkout's, unless set

from training.util import wait_for_port  # noqa: E402 (this checkout's, now first on the path)

ROOT = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.get("AIRFLOW_HOME", ROOT / ".airflow"))
PORT = int(os.environ.get("AIRFLOW_PORT", "8080"))
PARTS = {
    "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(PORT)],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        AIRFLOW_HOME=str(HOME),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(HOME / "passwords.json"),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{PORT}",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{PORT}/execution/",
    )
    # A task's first call to a cold api-server can take longer than the 5 s default on a small machine.
    env.setdefault("AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT", "60")
    return env


def _airflow() -> str:
    return str(Path(sys.executable).parent / "airflow")


def _pid_file(name: str) -> Path:
    return HOME / "run" / f"{name}.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def up() -> int:
    HOME.mkdir(parents=True, exist_ok=True)
    (HOME / "run").mkdir(exist_ok=True)
    (HOME / "logs").mkdir(exist_ok=True)
    pw_file = HOME / "passwords.json"
    first = not pw_file.exists()
    if first:
        pw_file.write_text(json.dumps({"admin": secrets.token_urlsafe(12)}))
        pw_file.chmod(0o600)
    env = _env()
    subprocess.run([_airflow(), "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    for name, args in PARTS.items():
        pf = _pid_file(name)
        if pf.exists() and _alive(int(pf.read_text())):
            print(f"{name}: already running (pid {pf.read_text().strip()})")
            continue
        log = open(HOME / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen([_airflow(), *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
        pf.write_text(str(proc.pid))
        print(f"{name}: started (pid {proc.pid}, log .airflow/logs/{name}.log)")
    try:
        wait_for_port(PORT, timeout=120)
    except TimeoutError:
        print("api-server did not open its port within 120 s; see .airflow/logs/api-server.log")
        return 1
    password = json.loads(pw_file.read_text())["admin"]
    print(f"\nAirflow UI: http://127.0.0.1:{PORT}  user: admin  password: {password}"
          + ("" if first else "  (kept in .airflow/passwords.json)"))
    print("The DAG starts paused: unpause distributed_training, then Trigger -> fill the form.")
    return 0


def down() -> int:
    for name in PARTS:
        pf = _pid_file(name)
        if not pf.exists():
            continue
        pid = int(pf.read_text())
        if _alive(pid):
            os.killpg(pid, signal.SIGTERM)
            for _ in range(30):
                if not _alive(pid):
                    break
                time.sleep(0.5)
            else:
                os.killpg(pid, signal.SIGKILL)
            print(f"{name}: stopped")
        pf.unlink()
    return 0


if __name__ == "__main__":
    sys.exit({"up": up, "down": down}[sys.argv[1]]())
