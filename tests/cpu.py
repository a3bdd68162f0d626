"""What each test costs in CPU seconds, the figure to cut when the suite is slow: on the 2-core
machine the suite keeps both cores busy, so its time is its CPU work divided by two, and a test's
wall time (``--durations``) says more about what ran beside it than about the test.

``TEST_CPU_REPORT=<file>``: every phase of every test (set-up, call, tear-down) appends a line to
``<file>``: the test's id, the phase, its wall seconds and its CPU seconds (user + system) of the
pytest process and of every child process it waited for (a torchrun group and its ranks, a script,
a server stopped by the fixture). At the end the 15 costliest files and tests are printed. A
session fixture's server is charged to the test whose tear-down stops it.

``resource.getrusage(RUSAGE_CHILDREN)`` counts a child once it has been waited for, which is
what subprocess does; no plugin on PyPI reports CPU time per test, hence this one.
"""

from __future__ import annotations

import collections
import os
import resource
import time

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _phase(item: pytest.Item, phase: str):
    path = os.environ.get("TEST_CPU_REPORT")
    if not path:
        yield
        return
    wall, cpu = time.monotonic(), _cpu()
    yield
    with open(path, "a", encoding="utf-8") as f:  # one short line per write: appends do not interleave
        f.write(f"{item.nodeid}\t{phase}\t{time.monotonic() - wall:.2f}\t{_cpu() - cpu:.2f}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield from _phase(item, "teardown")


def summary(path: str, top: int = 15) -> list[str]:
    """The costliest files and tests of a report, as lines to print."""
    tests: collections.Counter[str] = collections.Counter()
    for line in open(path, encoding="utf-8"):
        nodeid, _, _, cpu = line.rstrip("\n").split("\t")
        tests[nodeid] += float(cpu)
    files: collections.Counter[str] = collections.Counter()
    for nodeid, cpu in tests.items():
        files[nodeid.split("::")[0]] += cpu
    lines = [f"CPU seconds: {sum(tests.values()):.0f} in all, {len(tests)} tests ({path})"]
    lines += [f"{cpu:8.1f}  {name}" for name, cpu in files.most_common(top)]
    lines += ["", "costliest tests (set-up + call + tear-down):"]
    lines += [f"{cpu:8.1f}  {name}" for name, cpu in tests.most_common(top)]
    return lines


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    path = os.environ.get("TEST_CPU_REPORT")
    if path and os.path.exists(path) and not hasattr(config, "workerinput"):
        terminalreporter.section("CPU time per file (tests/cpu.py)")
        for line in summary(path):
            terminalreporter.write_line(line)
