"""What each test costs in CPU seconds, the figure to cut when the suite is slow: on the 2-core
machine the suite keeps both cores busy, so its time is its CPU work divided by two, and a test's
wall time (``--durations``) says more about what ran beside it than about the test.

``TEST_CPU_REPORT=<file>``: every phase of every test (set-up, call, tear-down) appends a line to
``<file>``: the test's id, the phase, its wall seconds and its CPU seconds (``cpu_seconds``). At
the end the 15 costliest files and tests are printed. tests/budget.py holds each test to a budget
of the same figure.

``cpu_seconds()`` is user + system time of the pytest process, of every child it has waited for
(``resource.getrusage(RUSAGE_CHILDREN)``: a torchrun group and its ranks, a script), and of every
descendant still running with the children that one has waited for (psutil: the live Airflow
stack's scheduler and the task processes it ran, a server a session fixture started). A phase's
cost is the difference of two readings, so a long-lived server is charged for what it did during
the phase, not for its life. Not counted: processes that leave the tree (a container runs under
podman's ``conmon``, outside it). No plugin on PyPI reports CPU time per test, hence this one.
"""

from __future__ import annotations

import collections
import os
import resource
import time

import psutil
import pytest


def cpu_seconds() -> float:
    """CPU seconds so far of this process, its waited-for children and its running descendants
    (with theirs); the difference of two readings is what ran in between (see the docstring)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
        except psutil.Error:  # it exited between the listing and the read: its waiter counts it
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _phase(item: pytest.Item, phase: str):
    path = os.environ.get("TEST_CPU_REPORT")
    if not path:
        yield
        return
    wall, cpu = time.monotonic(), cpu_seconds()
    yield
    with open(path, "a", encoding="utf-8") as f:  # one short line per write: appends do not interleave
        f.write(f"{item.nodeid}\t{phase}\t{time.monotonic() - wall:.2f}\t{cpu_seconds() - cpu:.2f}\n")


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
