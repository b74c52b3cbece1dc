"""The suite's own guards: a test that runs past the per-test budget fails, naming its phase and
the budget, and a test within it passes (tests/conftest.py's hook, run on a small suite of its own)."""

from __future__ import annotations

from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SUITE = """
import time

import pytest


@pytest.fixture(scope="module")
def shared():
    time.sleep(1.2)  # a module's expensive set-up counts against its first test
    return 1


def test_quick():
    assert True


def test_slow_call():
    time.sleep(1.2)


def test_slow_set_up(shared):
    assert shared == 1


def test_failing_on_its_own():
    assert 1 == 2
"""


def _run(pytester, monkeypatch, budget: str):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=SUITE)
    monkeypatch.setenv("STREAMSPEC_TEST_BUDGET", budget)
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")


def test_a_test_past_the_budget_fails_and_says_why(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "0.6")
    result.assert_outcomes(passed=1, failed=2, errors=1)
    for phase, name in (("call", "test_slow_call"), ("setup", "test_slow_set_up")):
        result.stdout.fnmatch_lines([f"*test_inner.py::{name}: its {phase} took * s, over the per-test budget of 0.6 s*"])
    assert "assert 1 == 2" in result.stdout.str()  # a failure of its own is reported as it is


def test_with_no_budget_the_same_tests_pass(pytester, monkeypatch):
    _run(pytester, monkeypatch, "0").assert_outcomes(passed=3, failed=1)


def test_a_budget_that_is_not_a_number_is_refused(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "four minutes")
    assert result.ret != 0
    assert "STREAMSPEC_TEST_BUDGET must be a number of seconds" in result.stderr.str()
