"""Shared fixtures. The environment is set at import time, before anything imports Airflow or
MLflow: a throw-away AIRFLOW_HOME with SQLite, a throw-away MLflow SQLite store, this project's
dags/ and plugins/ folders. Servers the tests need (moto's S3 server) bind 127.0.0.1 only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from training.distributed.launch import torchrun_command
from training.util import free_port, stop_process, wait_for_port  # noqa: F401 (tests import the first and last)

# The per-test budget (120 CPU seconds unless a test says why it needs more), the child processes
# make test-fast may start (one small torchrun), and TEST_CPU_REPORT's CPU seconds per test.
pytest_plugins = ["tests.cpu", "tests.budget", "tests.processes"]  # cpu first: budget imports it

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="dtp-tests-"))

os.environ.update(
    AIRFLOW_HOME=str(_TMP / "airflow"),
    AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
    AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__UNIT_TEST_MODE="False",
    MLFLOW_TRACKING_URI=f"sqlite:///{_TMP / 'mlflow' / 'mlflow.db'}",
    TRAINING_VAR_DIR=str(_TMP / "var"),
    TRAINING_CACHE_DIR=str(_TMP / "cache"),  # measured peaks, data gate verdicts: per test session
    TRAINING_DATA_CACHE=str(_TMP / "data-cache"),  # S3 datasets' local copies (training/data/sources.py)
    GLOO_SOCKET_IFNAME="lo",
    GX_ANALYTICS_ENABLED="False",
    MLFLOW_ENABLE_TELEMETRY="false",
    DO_NOT_TRACK="true",
    # Never let a test reach a real AWS account: dummy credentials, explicit loopback endpoints.
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_DEFAULT_REGION="us-east-1",
)
# One torch thread per process, the tests' own and every child's (as torchrun gives each rank): on
# a busy machine a second thread spins waiting for its sibling. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "plugins"), os.environ.get("PYTHONPATH")]))
(_TMP / "mlflow").mkdir(parents=True, exist_ok=True)
sys.path.insert(0, str(ROOT / "plugins"))


# `make test` runs the suite on three pytest-xdist workers (on two cores: much of the time a test
# waits on Airflow's scheduler, a container or a timeout, and the third worker uses those gaps).
# Tests that share an expensive fixture run on one worker, in their order, so it is built once:
# the session's live Airflow stack (the modules whose tests take ``live_airflow`` or ``live_runs``;
# test_live_policy.py starts an Airflow of its own and runs beside them), the container engine with
# the image it builds, and a module's fixture of module scope (trained runs that several tests
# read). Every other test goes to whichever worker is free; the longest single test (the 2-minute
# soak) starts first rather than last. Written here rather than with xdist's own `xdist_group`
# marker, which pytest-xdist 3.8 applies through a node attribute that pytest 9 no longer reads.
CONTAINER_MODULES = ("test_images.py", "test_pods.py")
FIRST = ("tests/e2e/test_soak.py",)


def pytest_xdist_make_scheduler(config, log):
    from functools import cache

    from xdist.scheduler import LoadScopeScheduling

    @cache
    def shares_a_module_fixture(path: str) -> bool:
        return 'scope="module"' in (Path(config.rootpath) / path).read_text(encoding="utf-8")

    @cache
    def uses_the_live_stack(path: str) -> bool:
        text = (Path(config.rootpath) / path).read_text(encoding="utf-8")
        return re.search(r"^def test_\w+\([^)]*\blive_(airflow|runs)\b", text, re.M) is not None

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            module = Path(path).name
            if uses_the_live_stack(path):
                return "live-airflow"
            if module in CONTAINER_MODULES:
                return "containers"
            return path if shares_a_module_fixture(path) else nodeid

        def _assign_work_unit(self, node) -> None:
            for scope in [s for s in self.workqueue if s.startswith(FIRST)]:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # One test queued behind the running one (xdist's own keeps two): a worker starts its next
            # test as soon as one ends either way, and at the end a free worker finds one more in the
            # queue instead of watching another worker's backlog of minute-long tests.
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return SharedFixtureScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def background_load():
    """TEST_BACKGROUND_LOAD=N: N CPU-bound processes run beside the whole session (tests/load.py)."""
    n = int(os.environ.get("TEST_BACKGROUND_LOAD") or 0)
    if not n:
        yield None
        return
    from tests.load import BackgroundLoad

    with BackgroundLoad(n) as load:
        yield load


@pytest.fixture(scope="session")
def tmp_root() -> Path:
    return _TMP


@pytest.fixture(scope="session")
def dataset(tmp_root: Path) -> Path:
    from training.data.synthetic import make_teacher_dataset

    root = tmp_root / "data" / "teacher"
    make_teacher_dataset(root, n_train=8_000, n_val=2_000, seed=0)
    return root


@pytest.fixture(scope="session")
def airflow_db() -> None:
    """A migrated Airflow metadata DB (SQLite) in the test AIRFLOW_HOME."""
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def _moto_endpoint():
    """moto's S3 server on 127.0.0.1, once per test process: a thread of this process serving real
    HTTP (``ThreadedMotoServer``), so no test pays a server's start-up and make test-fast starts no
    process for it. Fault tests that kill the server start their own (test_storage_faults.py)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_server(_moto_endpoint):
    """An empty S3 API over HTTP on 127.0.0.1 (moto; a real boto3 client reaches it), as
    ``AWS_ENDPOINT_URL`` for the test and the processes it starts. Yields ``{"endpoint": url}``."""
    import urllib.request

    # moto's own reset: every bucket and object of the tests before is gone.
    urllib.request.urlopen(urllib.request.Request(f"{_moto_endpoint}/moto-api/reset", method="POST"), timeout=30).close()
    old = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = _moto_endpoint
    try:
        yield {"endpoint": _moto_endpoint}
    finally:
        if old is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = old


def run_torchrun(nproc: int, sets: list[str], *, env: dict[str, str] | None = None, max_restarts: int = 0,
                 timeout: float = 300, popen: bool = False):
    """`torchrun ... -m training train --set k=v ...` on 127.0.0.1 with gloo, as a user would run it.
    A free port can be taken by another test's process between ``free_port`` and torchrun's bind:
    a launch that failed so before any rank started (EADDRINUSE, no ``train:`` line) is launched
    again on another port, up to twice."""
    # A run id only when the test passes one (the ranks then log to that MLflow run).
    base = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    full_env = {**base, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(3):
        cmd = torchrun_command([a for s in sets for a in ("--set", s)], nproc_per_node=nproc, master_port=free_port(),
                               max_restarts=max_restarts)
        if popen:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or "EADDRINUSE" not in out or "train: " in out:
            return proc
    return proc


def local_checkpoint(root: Path, step: int, files: dict[str, bytes], world_size: int = 2) -> Path:
    """A checkpoint folder as the trainer leaves it in a local ``checkpoint_dir``: its files, then
    ``manifest.json`` with each file's size and sha256 (what ``upload_checkpoint`` commits)."""
    import json

    from training.checkpoint.commit import MANIFEST, file_entry, new_manifest

    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    manifest = new_manifest(step=step, world_size=world_size, config_hash="abc",
                            files=[file_entry(name, d / name) for name in files])
    (d / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return d


def load_dag(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"dag_{name}", ROOT / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()
