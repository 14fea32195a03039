"""benchmarks/compare.py: a table from runs saved by separate invocations."""

import importlib.util
from pathlib import Path

import pytest

from protofl.report import RunRecorder

ROOT = Path(__file__).resolve().parents[1]


def load_compare():
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_run(directory, label, accuracies):
    recorder = RunRecorder(directory / label, {"num_server_rounds": len(accuracies)})
    for server_round, accuracy in enumerate(accuracies, start=1):
        recorder.update(server_round, global_accuracy=accuracy, bytes_up=10, bytes_down=10, seconds=1.0)
    recorder.write()


def test_include_builds_one_table_from_runs_saved_apart(tmp_path):
    saved_run(tmp_path / "first", "fedavg", [0.5, 0.7, 0.6])
    saved_run(tmp_path / "second", "fedsc", [0.6, 0.8, 0.75])
    compare = load_compare()
    out = tmp_path / "table"
    assert compare.main(["--include", str(tmp_path / "first"), "--include", str(tmp_path / "second"),
                         "--out", str(out)]) == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in (out / "comparison.md").read_text().splitlines()}
    assert "0.6000 | 0.7000 (2)" in rows["fedavg"] and "0.7500 | 0.8000 (2)" in rows["fedsc"]
    with pytest.raises(SystemExit, match="no <label>/results.json"):
        compare.main(["--include", str(tmp_path / "missing"), "--out", str(out)])
