"""CI's check of the fast suite's time (tests/time_budget.py): a session over its --time-budget
fails, one within it passes, and without the option nothing is checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("budget, code, said", [
    (["--time-budget", "0.05"], 1, "OVER BUDGET: the session took"),
    (["--time-budget", "600"], 0, "its time budget is 600 s"),
    ([], 0, None),
])
def test_a_session_over_its_time_budget_fails(tmp_path, budget, code, said):
    (tmp_path / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(0.2)\n")
    env = os.environ | {"PYTHONPATH": str(TESTS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "time_budget", "-p", "no:cacheprovider", "-q",
                           str(tmp_path / "test_sleeps.py"), *budget],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    if said:
        assert said in done.stdout
    else:
        assert "budget" not in done.stdout
