"""The per-test time budget (tests/budget.py) fails a test that runs past it, and honours a
test's own budget with its reason; checked in-process with pytester (no child process)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SLOW = """
import time
import pytest

def test_over():
    time.sleep(0.3)

@pytest.mark.budget(5, reason="sleeps on purpose")
def test_marked():
    time.sleep(0.3)

def test_quick():
    pass
"""


def test_a_test_over_its_budget_fails_naming_its_time_and_the_fix(pytester, monkeypatch):
    monkeypatch.setenv("TEST_BUDGET_S", "0.1")
    monkeypatch.delenv("TEST_BUDGET_SCALE", raising=False)
    pytester.makeconftest("pytest_plugins = ['tests.budget']")
    pytester.makepyfile(test_slow=SLOW)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:xdist")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_over passed but took * s, over its budget of 0.1 s*"
                                 "mark it @pytest.mark.budget(<seconds>, reason=...)*"])
    monkeypatch.setenv("TEST_BUDGET_S", "0")  # 0: no budget
    pytester.runpytest_inprocess("-p", "no:xdist").assert_outcomes(passed=3)


def test_a_budget_without_a_reason_is_refused_at_collection(pytester):
    pytester.makeconftest("pytest_plugins = ['tests.budget']")
    pytester.makepyfile(test_bare="import pytest\n\n@pytest.mark.budget(300)\ndef test_x():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "write @pytest.mark.budget(<seconds>, reason='why it needs them')" in result.stderr.str()
