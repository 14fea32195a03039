import os
import sys
from pathlib import Path

import pytest

# deploy/native.py (the compose topology as local processes) is shared by tests and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

# Flower must not build a fresh venv per run (it would download CUDA torch), nor touch ~/.flwr.
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


@pytest.fixture(autouse=True)
def _flower_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.mktemp("flwr-home")))
