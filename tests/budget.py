"""The per-test budget: a test whose body costs more than its budget fails, naming its cost, the
budget and the fix, so the suite cannot creep back to the hour it once took.

The budget is in CPU seconds (``DEFAULT_S``, 120) of the test's own call, not its set-up: what the
test process, the processes it started and the live stack's processes did during the call
(``tests/cpu.py``, ``cpu_seconds``). CPU seconds, not wall seconds, because wall time on this
2-core machine grows with whatever runs beside the suite: with one core taken by another job, two
tests within a wall budget in CI went over it (a fine-tune, 152 s against 120; the README's
language model, 408 s against 360; 2026-12-06) while the work they did was the same. A test that
waits (a sleep, a poll of a DAG run) costs little; a test that trains more steps, or more ranks,
or starts more processes costs more, and that is the creep the budget catches. A session fixture that trains a checkpoint or starts the
live Airflow is paid once, by whichever test comes first, and is bounded by the suite's total
instead. A test that needs more says so and why::

    @pytest.mark.budget(300, reason="trains 2 ranks to a target, then resumes them")

A budget without a reason is refused when the tests are collected. ``TEST_BUDGET_S`` sets the
default (``0``: no budget, e.g. under a debugger); ``TEST_BUDGET_SCALE`` multiplies every budget,
for a machine known to be slower than the 2-core one the budgets were set on.

pytest has no per-test time limit of its own that reports rather than kills (pytest-timeout kills
the test at the limit and loses its result), hence this hook.
"""

from __future__ import annotations

import os

import pytest

from tests.cpu import cpu_seconds

DEFAULT_S = 120.0


def _budget(item: pytest.Item) -> float:
    mark = item.get_closest_marker("budget")
    base = float(mark.args[0]) if mark is not None else float(os.environ.get("TEST_BUDGET_S", DEFAULT_S))
    return base * float(os.environ.get("TEST_BUDGET_SCALE", "1"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "budget(seconds, reason): this test's own budget in CPU seconds, over the "
                                       f"default {DEFAULT_S:.0f}, and why it needs it (tests/budget.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark = item.get_closest_marker("budget")
        if mark is None:
            continue
        seconds, reason = (mark.args[0] if mark.args else None), mark.kwargs.get("reason", "")
        if not isinstance(seconds, (int, float)) or seconds <= 0 or not str(reason).strip():
            raise pytest.UsageError(f"{item.nodeid}: write @pytest.mark.budget(<seconds>, reason='why it needs "
                                    f"them'), got budget{mark.args}{mark.kwargs or ''}")


_SPENT = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    start = cpu_seconds()
    yield
    item.stash[_SPENT] = cpu_seconds() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.passed:
        return
    budget, spent = _budget(item), item.stash.get(_SPENT, 0.0)
    if budget > 0 and spent > budget:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} passed but cost {spent:.1f} CPU seconds ({report.duration:.1f} s of wall "
                           f"time), over its budget of {budget:.1f} CPU seconds (tests/budget.py). Make it cheaper "
                           "(a smaller model, fewer steps, a shared session fixture), or mark it "
                           "@pytest.mark.budget(<seconds>, reason=...) saying why it needs them.")
