"""``--time-budget SECONDS``: the session fails (exit code 1) when it took longer, naming its time
and the budget; CI gives the fast suite its budget (.ci/run), with ``--durations`` listing the
slowest tests beside it. Off unless given: a slower laptop still runs the suite."""

import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--time-budget", type=float, default=None, metavar="SECONDS",
                     help="fail the session when it takes longer than SECONDS (wall clock)")


def pytest_sessionstart(session):
    session.config.stash[_START] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    budget = session.config.getoption("--time-budget")
    if budget is None:
        return
    took = time.monotonic() - session.config.stash[_START]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = f"the session took {took:.1f} s, its time budget is {budget:g} s"
    if reporter is not None:
        reporter.write("\n")
    if took > budget:
        if reporter is not None:
            reporter.write_line(f"OVER BUDGET: {line}", red=True, bold=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter is not None:
        reporter.write_line(line)


_START = pytest.StashKey[float]()
