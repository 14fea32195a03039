import os
import sys
from pathlib import Path

import pytest
import torch

# deploy/native.py (the compose topology as local processes) is shared by tests and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

pytest_plugins = ["time_budget"]  # --time-budget SECONDS (CI's check of the fast suite)

# Flower must not build a fresh venv per run (it would download CUDA torch), nor touch ~/.flwr.
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# Ray's workers (the simulations' ClientApps) at normal priority, as setup.sh's activate script runs
# them: at Ray's default niceness (15) they starved beside CI's other sessions
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(autouse=True)
def _flower_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.mktemp("flwr-home")))


@pytest.fixture(autouse=True)
def _float64_in_conformance_tests(request):
    """The conformance tests compare protofl with fixtures the authors' code computed in float64
    (tests/conformance/common.py): torch's default dtype is float64 while one runs."""
    if request.node.get_closest_marker("conformance") is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
