"""The per-test budget (tests/budget.py) fails a test whose call costs more CPU seconds than it,
counts the CPU of the processes the test starts, not the time it waits, and honours a test's own
budget with its reason; checked in-process with pytester (the one child is a shell, not Python)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SLOW = """
import subprocess
import time
import pytest

def _busy(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass

def test_over():
    _busy(0.3)

@pytest.mark.budget(5, reason="works on purpose")
def test_marked():
    _busy(0.3)

def test_a_child_counts():
    subprocess.run(["sh", "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"], check=True)

@pytest.mark.budget(1, reason="waits on purpose")
def test_waiting_is_free():
    time.sleep(1.5)  # past a wall-time budget of 1 s; a CPU budget of 1 s is for work
"""


def test_a_test_over_its_budget_fails_naming_its_time_and_the_fix(pytester, monkeypatch):
    monkeypatch.setenv("TEST_BUDGET_S", "0.1")
    monkeypatch.delenv("TEST_BUDGET_SCALE", raising=False)
    pytester.makeconftest("pytest_plugins = ['tests.budget']")
    pytester.makepyfile(test_slow=SLOW)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:xdist")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*test_over passed but cost * CPU seconds (* s of wall time), over its budget of "
                                 "0.1 CPU seconds*mark it @pytest.mark.budget(<seconds>, reason=...)*"])
    assert "FAILED test_slow.py::test_a_child_counts" in result.stdout.str()  # the shell's loop is the test's cost
    # A second and a half asleep costs next to nothing (the pytest process and any Airflow stack it
    # started idle at a few CPU seconds a minute), so a job beside the suite cannot fail it.
    assert "test_waiting_is_free passed but" not in result.stdout.str()
    monkeypatch.setenv("TEST_BUDGET_S", "0")  # 0: no budget
    pytester.runpytest_inprocess("-p", "no:xdist").assert_outcomes(passed=4)


def test_a_budget_without_a_reason_is_refused_at_collection(pytester):
    pytester.makeconftest("pytest_plugins = ['tests.budget']")
    pytester.makepyfile(test_bare="import pytest\n\n@pytest.mark.budget(300)\ndef test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "write @pytest.mark.budget(<seconds>, reason='why it needs them')" in result.stderr.str()
