"""presets/*.toml: each parses as Flower parses `--run-config <file>`, names only known keys with
valid values, states its federation, and runs a round on generated data of the real format."""

import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from fakes import write_cifar
from flwr.common.config import parse_config_args
from test_data import write_idx

from protofl.settings import ExperimentSettings, default_run_config
from protofl.strategies import get_method

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "presets").glob("*.toml"))
DEFAULTS = default_run_config(ROOT / "pyproject.toml")
FEDERATION_KEYS = {"num-supernodes", "client-resources-num-cpus", "client-resources-num-gpus"}
# backbones too slow for a CPU test round: the CNN of the same input shape instead. The model families
# too: their torchvision ResNets took 22-53 s of a preset's round (a step of tv-resnet18 on ten 28x28
# images, 259 ms on the AMD VM, the CNN's 18 ms), and every family architecture trains in
# tests/test_backbones.py's family runs
FAST_MODEL = {"resnet10": "cnn", "resnet8-x4": "cnn", "htfe2": "cnn", "htfe8": "cnn"}


def federation(path: Path) -> dict[str, float]:
    line = re.search(r"^# federation-config: (.+)$", path.read_text(), re.MULTILINE)
    assert line, f"{path.name} does not state its federation"
    return {key: tomllib.loads(f"v = {value}")["v"] for key, value in re.findall(r"(\S+)=(\S+)", line.group(1))}


def test_there_is_a_preset_for_each_paper_setting_asked_for():
    names = {p.stem for p in PRESETS}
    assert {f"fednh-{d}-dir{a}" for d in ("cifar10", "cifar100") for a in ("0.3", "1.0")} <= names
    assert {f"fedsa-{d}-{s}" for d in ("cifar10", "cifar100") for s in ("cross-silo", "cross-device")} <= names
    assert {"fedsa-cifar100-cross-device-htfe2", "fedsa-cifar100-cross-device-htfe8"} <= names
    assert {"fedsc-cifar10-dir0.2", "fedskc-cifar10-dir0.2"} <= names
    assert {"fedcosr-cifar10-dir0.1", "fedcosr-cifar10-pathological"} <= names
    assert len([n for n in names if n.startswith("fmnist-")]) >= 6


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_parses_into_known_keys_and_valid_settings(path):
    preset = parse_config_args([str(path)])  # what `flwr run . --run-config <file>` reads
    unknown = sorted(set(preset) - set(DEFAULTS))
    assert not unknown, f"{path.name}: keys the app does not have: {unknown}"
    settings = ExperimentSettings.from_run_config(DEFAULTS | preset)
    get_method(settings.method)[0].options_class.from_settings(settings)  # the method's table is valid
    fed = federation(path)
    assert set(fed) <= FEDERATION_KEYS and fed["num-supernodes"] >= settings.min_fit_clients
    assert f"--run-config presets/{path.name}" in path.read_text()


def test_no_preset_changes_the_screen():
    """The default screen drops no honest client in any table (docs/results/screen.md): a preset that
    widened it would weaken it for every other kind of upload in its runs."""
    assert [p.name for p in PRESETS if "screen-factor" in parse_config_args([str(p)])] == []


TABLES = {  # each seed paper's comparison table: its methods (baselines.md), in its order
    "fedskc-table1": ["fedavg", "fedprox", "scaffold", "fedopt", "moon", "fedproto", "fednh", "fedrcl", "fedskc"],
    "fedsc-table1": ["fedavg", "fedprox", "moon", "fedntd", "fedproto", "fednh", "fedrcl", "fedcda", "fedsc"],
    "fednh-table1": ["local", "fedavg", "fedper", "ditto", "fedrep", "fedproto", "creff", "fedbabu", "fedrod", "fednh"],
    "fedsa-table1": ["lgfedavg", "fedgen", "fml", "fedkd", "feddistill", "fedproto", "fedtgp", "fedsa"],
    "fedsa-table2": ["lgfedavg", "fedgen", "fml", "fedkd", "feddistill", "fedproto", "fedtgp", "fedsa"],
    "fedcosr-table2": ["local", "fedavg", "fedprox", "moon", "pfedme", "ditto", "perfedavg", "fedrep", "lgfedavg",
                       "fedper", "fedamp", "fedala", "fedproto", "fedpac", "fedgh", "fedcosr"],
}
TABLES["fedcosr-table3"] = TABLES["fedcosr-table2"]  # Table III-a: Table II's methods at 100 clients


@pytest.mark.parametrize("path", [p for p in PRESETS if "-table" in p.stem], ids=lambda p: p.stem)
def test_a_table_preset_names_its_papers_methods_each_valid_with_its_settings(path):
    """benchmarks/compare.py --preset runs every method of a table preset (its # methods: lines)."""
    text = path.read_text()
    methods = [m for line in re.findall(r"^# methods:(.*)$", text, re.M) for m in line.split()]
    assert methods == next(v for k, v in TABLES.items() if k in path.stem)
    preset = DEFAULTS | parse_config_args([str(path)])
    for method in methods:
        settings = ExperimentSettings.from_run_config(preset | {"method": method})
        get_method(method)[0].options_class.from_settings(settings)


def test_each_table_has_a_preset_on_cifar_and_on_fashion_mnist():
    names = {p.stem for p in PRESETS}
    assert all({f"{table}-cifar10", f"{table}-cifar100"} & names for table in TABLES)  # FedSA's Table 2: CIFAR-100
    assert {f"fmnist-{table}" for table in TABLES} <= names


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """Generated files in each data set's real on-disk format (random pixels, every class present)."""
    root = tmp_path_factory.mktemp("preset-data")
    (root / "cifar10").mkdir()
    write_cifar(root / "cifar10", 10, [300] * 5, 300)
    (root / "cifar100").mkdir()
    write_cifar(root / "cifar100", 100, [1500], 300)
    rng = np.random.default_rng(0)
    (root / "fmnist").mkdir()
    for prefix, n in (("train", 1500), ("t10k", 300)):
        write_idx(root / "fmnist" / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), compress=False)
        write_idx(root / "fmnist" / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10, compress=False)
    (root / "emnist").mkdir()  # EMNIST Balanced: 47 classes
    for split, n in (("train", 4700), ("test", 470)):
        write_idx(root / "emnist" / f"emnist-balanced-{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)),
                  compress=False)
        write_idx(root / "emnist" / f"emnist-balanced-{split}-labels-idx1-ubyte", np.arange(n) % 47, compress=False)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_runs_a_round(path, data_dirs, tmp_path):
    from inprocess import run_in_process

    preset = DEFAULTS | parse_config_args([str(path)])
    # at most 10 clients: the generated files hold 1,800 (5,170 of EMNIST's) images, not CIFAR's 60,000 (PFLlib's
    # split would find no draw giving 100 clients 40 samples each), and a round stays short
    clients = min(int(federation(path)["num-supernodes"]), 10)
    preset |= {"data-dir": str(data_dirs / preset["dataset"]), "num-server-rounds": 1, "local-epochs": 1,
               "model": FAST_MODEL.get(preset["model"], preset["model"]), "output-dir": str(tmp_path),
               "run-name": path.stem, "min-fit-clients": min(preset["min-fit-clients"], clients),
               "data-fraction": 1.0}  # the generated set is small already: no further cut
    strategy, messages = run_in_process(preset, num_nodes=clients)
    record = strategy.recorder.rounds[1]
    assert not record.get("dropped"), record["dropped"]
    trained = sum(kind == "fit" for kind, _, _ in messages)
    assert trained == max(preset["min-fit-clients"], int(preset["fraction-fit"] * clients))
    assert record["personalized_accuracy"] is not None
    assert (record.get("global_accuracy") is None) == (preset["pool"] == "train+test" or not strategy.has_global_model)
