"""benchmarks/compare.py: a table from runs saved by separate invocations."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from protofl.report import RunRecorder

ROOT = Path(__file__).resolve().parents[1]


def load_compare():
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_run(directory, label, accuracies, seed=0):
    recorder = RunRecorder(directory / label, {"num_server_rounds": len(accuracies), "seed": seed})
    for server_round, accuracy in enumerate(accuracies, start=1):
        recorder.update(server_round, global_accuracy=accuracy, bytes_up=10, bytes_down=10, seconds=1.0,
                        server_seconds=0.25 * server_round)
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
    assert rows["fedavg"].endswith("| 1.00 | 0.500 |")  # s / round, and the server rule's (0.25, 0.5, 0.75 s)
    with pytest.raises(SystemExit, match="no <label>/results.json"):
        compare.main(["--include", str(tmp_path / "missing"), "--out", str(out)])


def test_seeds_give_mean_std_and_paired_differences_with_an_interval(tmp_path):
    # final GM per seed: fedavg 0.60 0.70 0.80; fedsc 0.65 0.80 0.85 -> differences 5, 10, 5 points
    for seed, (base, new) in enumerate([(0.6, 0.65), (0.7, 0.8), (0.8, 0.85)]):
        saved_run(tmp_path / "runs" / "fedavg", f"seed-{seed}", [0.5, base], seed)
        saved_run(tmp_path / "runs" / "fedsc", f"seed-{seed}", [0.5, new], seed)
    compare = load_compare()
    out = tmp_path / "table"
    assert compare.main(["--include", str(tmp_path / "runs"), "--baseline", "fedavg", "--out", str(out)]) == 0
    report = (out / "comparison.md").read_text()
    repeats = report.split("## Paired")[0].splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in repeats if line.startswith("| fed")}
    # mean 0.7, sample std 0.1; fedsc mean 0.7667, std sqrt(((-.1167)^2 + .0333^2 + .0833^2) / 2) = 0.1041
    assert "0.7000 ± 0.1000" in rows["fedavg"] and "0.7667 ± 0.1041" in rows["fedsc"]
    # differences: mean 6.67, sd 2.887, t(0.975, 2) = 4.303: half-width 4.303 * 2.887 / sqrt(3) = 7.17
    difference_rows = [line for line in report.split("Paired difference")[1].splitlines() if line.startswith("| fedsc")]
    assert difference_rows[0].startswith("| fedsc | 3 | +6.67 [-0.50, +13.84] |")
    assert (out / "comparison.png").stat().st_size > 0
    # a run still going (results.json is written every round) is left out, not averaged in
    recorder = RunRecorder(tmp_path / "runs" / "fedprox" / "seed-0", {"num_server_rounds": 5, "seed": 0})
    recorder.update(1, global_accuracy=0.1)
    recorder.write()
    assert compare.main(["--include", str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert "fedprox" not in (out / "comparison.md").read_text()
    with pytest.raises(SystemExit, match="--baseline 'fedprox'"):
        compare.main(["--include", str(tmp_path / "runs"), "--baseline", "fedprox", "--out", str(out)])


def test_sweep_labels_every_run_once_per_value():
    compare = load_compare()
    runs = compare.swept([("fedavg", "method='fedavg'")], ["lr=0.01,0.05", "fedavg.weighted=true,false"])
    assert [label for label, _ in runs] == [
        "fedavg_lr=0.01_fedavg.weighted=true", "fedavg_lr=0.01_fedavg.weighted=false",
        "fedavg_lr=0.05_fedavg.weighted=true", "fedavg_lr=0.05_fedavg.weighted=false",
    ]
    assert runs[1][1] == "method='fedavg' lr=0.01 fedavg.weighted=false"


def sent_run_configs(compare, monkeypatch) -> list[str]:
    """The ``--run-config`` of every `flwr run` ``compare`` starts from now on (none runs: each fails)."""
    sent = []

    def flwr_run(command, **_):
        sent.append(command[command.index("--run-config") + 1])
        return SimpleNamespace(returncode=1)

    monkeypatch.setattr(compare.subprocess, "run", flwr_run)
    return sent


def test_a_preset_key_given_again_is_one_override_the_later_value_wins(tmp_path, monkeypatch):
    """The preset sets `method`, `lr` and `run-name`; `--run-config`, `--methods`, `--variant` and the runner
    set them again. Flower refuses a run config that names a key twice: each run gets one value, the later."""
    from flwr.common.config import parse_config_args

    compare = load_compare()
    sent = sent_run_configs(compare, monkeypatch)
    preset = tmp_path / "preset.toml"
    preset.write_text("method = \"fedavg\"\nlr = 0.05\nrun-name = \"x\"\nnote = \"two words\"\n")
    compare.main(["--preset", str(preset), "--run-config", "lr=0.1", "--methods", "fedskc",
                  "--variant", "fedsc-code=method='fedsc' fedsc.rpcl-form='code'", "--seeds", "1", "--out", str(tmp_path)])
    configs = [parse_config_args([config]) for config in sent]
    assert configs == [
        {"method": "fedskc", "lr": 0.1, "note": "two words", "run-name": "seed-1", "seed": 1, "output-dir": str(tmp_path / "fedskc"),
         "overwrite": True},
        {"method": "fedsc", "lr": 0.1, "note": "two words", "run-name": "seed-1", "fedsc.rpcl-form": "code", "seed": 1,
         "output-dir": str(tmp_path / "fedsc-code"), "overwrite": True},
    ]


def test_every_run_names_its_federation_whatever_flower_home_holds(tmp_path, monkeypatch):
    """From an empty FLWR_HOME Flower would simulate its own default (2 SuperNodes, 2 CPUs each):
    a benchmark's run names its federation, the one asked for, completed by the project's default
    (10 SuperNodes, 1 CPU each) or the preset's ``# federation-config:`` line."""
    compare, sent = load_compare(), []

    def flwr_run(command, **_):
        sent.append(command[command.index("--federation-config") + 1] if "--federation-config" in command else None)
        return SimpleNamespace(returncode=1)

    monkeypatch.setattr(compare.subprocess, "run", flwr_run)
    compare.main(["--methods", "fedavg", "--out", str(tmp_path)])
    compare.main(["--methods", "fedavg", "--federation-config", "num-supernodes=20", "--out", str(tmp_path)])
    preset = tmp_path / "preset.toml"
    preset.write_text("# federation-config: num-supernodes=100 client-resources-num-gpus=0.0999\nmethod = \"fedavg\"\n")
    compare.main(["--preset", str(preset), "--methods", "fedavg", "--out", str(tmp_path)])
    assert sent == ["num-supernodes=10 client-resources-num-cpus=1",
                    "num-supernodes=20 client-resources-num-cpus=1",
                    "num-supernodes=100 client-resources-num-gpus=0.0999 client-resources-num-cpus=1"]


def test_a_table_preset_runs_every_method_it_names_each_with_the_presets_settings(tmp_path, monkeypatch):
    compare = load_compare()
    sent = sent_run_configs(compare, monkeypatch)
    preset = tmp_path / "table.toml"
    preset.write_text("# methods: fedavg moon\n# methods: fedsc\n"
                      "# variant: fedsc-code=method='fedsc' fedsc.rpcl-form='code'\n"
                      "method = \"fedskc\"\nalpha = 0.05\n\n[moon]\nmu = 5.0\n")
    compare.main(["--preset", str(preset), "--run-config", "alpha=0.2", "--out", str(tmp_path)])
    assert [compare.config_pairs(config)["method"] for config in sent] == ["'fedavg'", "'moon'", "'fedsc'", "'fedsc'"]
    assert all(compare.config_pairs(config)["alpha"] == "0.2" and "moon.mu=5.0" in config for config in sent)
    assert "fedsc.rpcl-form='code'" in sent[-1]
    sent.clear()
    compare.main(["--preset", str(preset), "--methods", "fedprox", "--out", str(tmp_path)])  # named: only those
    assert [compare.config_pairs(config)["method"] for config in sent] == ["'fedprox'"]
