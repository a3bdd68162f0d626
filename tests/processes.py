"""What child processes the tests start: ``make test-fast`` is the edit loop, so it starts no Python
process but one small torchrun (the test marked ``smoke_torchrun``), and this plugin holds it to
that. A Python process is what costs: each imports torch, Airflow or MLflow for seconds before it
does anything. The contract checkers that are programs of their own (hadolint, promtool, the
Compose CLI, git) start in milliseconds and stay in the loop.

``TEST_CHILD_PROCESSES`` (``make test-fast`` sets ``refuse``):

- ``refuse``: a test not marked ``slow`` that starts a Python process (``subprocess``, which
  ``torchrun``, servers and the CLIs all go through, or ``multiprocessing``) fails there, naming
  the command and the fix; the one ``smoke_torchrun`` test may.
- ``audit:<file>``: every child process a test starts is appended to ``<file>`` (the test's id and
  the command, one per line), to see what a change made the suite start.
- unset: nothing is watched (``make test``).

Python's own hooks see a process only once it runs (``sys.addaudithook`` has no way to refuse
one by test), hence the wrap of ``Popen`` here.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shlex
import shutil
import subprocess

import pytest

_current: list[pytest.Item] = []
MARK = "smoke_torchrun"


def _mode() -> str:
    return os.environ.get("TEST_CHILD_PROCESSES", "")


def is_python(program: str) -> bool:
    """Whether ``program`` (argv[0]) is a Python interpreter or a script run by one (a console
    script such as torchrun, airflow or moto_server)."""
    path = shutil.which(program) or program
    if os.path.basename(path).startswith("python"):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _check(what: str, python: bool = True) -> None:
    item = _current[-1] if _current else None
    if item is None:
        return
    mode = _mode()
    if mode.startswith("audit:"):
        with open(mode.removeprefix("audit:"), "a", encoding="utf-8") as f:
            f.write(f"{item.nodeid}\t{'python' if python else 'program'}\t{' '.join(what[:300].split())}\n")
    elif mode == "refuse" and python and not item.get_closest_marker("slow") and not item.get_closest_marker(MARK):
        raise RuntimeError(f"{item.nodeid} starts a child process ({what[:200]}), which make test-fast does not "
                           "(tests/processes.py): check it in-process, or mark the test @pytest.mark.slow")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}: the one test of make test-fast that may start a process (a small "
                                       "torchrun; tests/processes.py)")
    if not _mode():
        return
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def init(self, args, *a, **kw):
        argv = shlex.split(args) if isinstance(args, str) else [os.fspath(x) for x in args]
        program = kw.get("executable") or (argv[0] if argv else "")
        if kw.get("shell"):
            program = argv[0] if argv else ""
        _check(" ".join(argv), is_python(os.fspath(program)))
        popen_init(self, args, *a, **kw)

    def start(self):
        _check(f"multiprocessing {self.name} {getattr(self, '_target', '')}")
        process_start(self)

    subprocess.Popen.__init__ = init
    multiprocessing.process.BaseProcess.start = start


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item.nodeid for item in items if item.get_closest_marker(MARK)]
    if len(marked) > 1:
        raise pytest.UsageError(f"only one test may be marked {MARK} (make test-fast starts one torchrun): {marked}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()
