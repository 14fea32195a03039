"""benchmarks/throughput.py: samples per second on stand-in data of a data set's shapes."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from protofl.settings import ExperimentSettings
from protofl.task.data import SHAPES, load_dataset
from protofl.task.precision import resolve_amp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import throughput  # noqa: E402

DIGITS_TRAIN, DIGITS_TEST = SHAPES["digits"][2:]


def test_the_digits_shapes_are_those_loaded():
    channels, size, num_train, num_test = SHAPES["digits"]
    dataset = load_dataset("digits")
    assert dataset.train.images.shape == (num_train, channels, size, size) and len(dataset.test) == num_test


def test_stand_in_clients_split_the_whole_pool_and_share_the_global_test_set_without_a_local_one():
    settings = ExperimentSettings(test_fraction=0.0, partition="iid")
    clients = throughput.stand_in_clients(settings, 3, torch.device("cpu"))
    assert sum(len(train_y) for _, train_y, _, _ in clients) == DIGITS_TRAIN
    assert all(test_x is clients[0][2] and len(test_x) == DIGITS_TEST for _, _, test_x, _ in clients)
    assert clients[0][0].shape[1:] == (1, 16, 16) and clients[0][0].dtype == torch.float32


@pytest.mark.slow  # the benchmark's main on real clients: about 1 s
def test_main_reports_finite_rates_for_each_batch_size_over_what_the_clients_hold(tmp_path):
    threads = torch.get_num_threads()
    try:
        code = throughput.main(["--run-config", "dataset='digits' model='cnn'", "--num-clients", "2", "--rounds", "1",
                                "--batch-sizes", "10,32", "--device", "cpu", "--threads", "1", "--out", str(tmp_path),
                                "--variant", "fp32=amp='off' channels-last=false", "--variant", "defaults="])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    summary = json.loads((tmp_path / "throughput.json").read_text())
    clients = summary["data"]["clients"]
    assert len(clients) == 2 and sum(c["num_train"] + c["num_test"] for c in clients) == DIGITS_TRAIN
    # each batch size's variants side by side, in the order given
    assert [(r["batch_size"], r["variant"]) for r in summary["results"]] == [
        (10, "fp32"), (10, "defaults"), (32, "fp32"), (32, "defaults")]
    assert {(r["variant"], r["amp"], r["autocast"], r["channels_last"], r["memory_format"], r["step"])
            for r in summary["results"]} == {("fp32", "off", "off", False, "NCHW", "off"),
                                             ("defaults", "auto", resolve_amp("auto", torch.device("cpu")), "auto",
                                              "channels-last", "off")}  # the CNN trains faster so; no capture on a CPU
    for result in summary["results"]:
        assert result["train_samples_per_round"] == sum(c["num_train"] for c in clients)
        assert result["eval_samples_per_round"] == sum(c["num_test"] for c in clients)
        for key in ("train_samples_per_second", "eval_samples_per_second", "mean_seconds_per_round"):
            assert math.isfinite(result[key]) and result[key] > 0
        assert len(result["seconds_per_round"]) == 1
    assert summary["device"] == "cpu (1 threads)" and summary["date"] and summary["machine"]
    assert "benchmarks/throughput.py" in summary["command"]
    table = (tmp_path / "throughput.md").read_text()
    assert "| cnn | fp32 | off | NCHW | off | 10 |" in table and table.count("| 1.00x |") >= 2  # each reference


@pytest.mark.slow  # two processes, each importing torch and measuring: ~25 s
def test_processes_measure_at_once_and_the_table_sums_their_rates(tmp_path):
    code = throughput.main(["--run-config", "dataset='digits'", "--num-clients", "2", "--rounds", "1", "--device", "cpu",
                            "--threads", "1", "--processes", "2", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "throughput.json").read_text())
    each = [json.loads((tmp_path / f"process-{i}" / "throughput.json").read_text())["results"][0] for i in range(2)]
    assert summary["processes"] == 2 and summary["device"] == "2 x cpu (1 threads)"
    (combined,) = summary["results"]
    assert combined["train_samples_per_second"] == sum(r["train_samples_per_second"] for r in each)
    assert combined["mean_seconds_per_round"] == max(r["mean_seconds_per_round"] for r in each)
    assert "2 processes at once" in (tmp_path / "throughput.md").read_text()
