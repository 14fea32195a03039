"""The server template without Ray: hand-built FitRes/EvaluateRes lists into aggregate_*."""

import json
import socket

import numpy as np
import pytest
from fakes import OK, FakeProxy, start_round
from flwr.common import EvaluateRes, FitRes, Parameters, ndarrays_to_parameters

from protofl.federation.admission import DIVERGED_HINT, too_few_updates
from protofl.federation.server import RunStopped, legacy_strategy
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, ClassStatistics, describe_failure
from protofl.settings import ExperimentSettings
from protofl.strategies.fedavg import FedAvgStrategy
from protofl.strategies.fedproto import FedProtoStrategy
from protofl.task.models import build_model

C, D = 10, 512


def make_strategy(cls, tmp_path, **overrides):
    config = ExperimentSettings(output_dir=str(tmp_path), run_name="run", **overrides)
    strategy = legacy_strategy(cls)(config, build_model("cnn", 1, C, 16, seed=0), C)
    start_round(strategy, range(4))
    return strategy


def proto_result(pid, prototypes, counts, **extra):
    metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(prototypes, counts).to_metrics()}
    metrics.update(extra)
    parameters = Parameters(tensors=[], tensor_type="numpy.ndarray")
    return FakeProxy(str(100 + pid)), FitRes(OK, parameters, int(np.sum(counts)), metrics)


def test_malformed_payload_is_dropped_and_round_goes_on(tmp_path, caplog):
    strategy = make_strategy(FedProtoStrategy, tmp_path)
    good_a = proto_result(0, np.full((C, D), 1.0, np.float32), np.array([2] + [0] * 9))
    good_b = proto_result(1, np.full((C, D), 4.0, np.float32), np.array([6] + [0] * 9))
    garbage = proto_result(2, np.zeros((C, D), np.float32), np.zeros(C, np.int64))
    garbage[1].metrics[CLASS_MEANS] = b"\x93NUMPY-not-really"
    wrong_shape = proto_result(3, np.zeros((C, D + 1), np.float32), np.ones(C, np.int64))
    _, metrics = strategy.aggregate_fit(1, [good_a, garbage, good_b, wrong_shape], [])
    assert metrics["accepted"] == 2
    np.testing.assert_allclose(strategy.global_prototypes.vectors[0], 1.0 * 0.25 + 4.0 * 0.75)
    assert strategy.global_prototypes.mask.tolist() == [True] + [False] * 9
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "node 102" in messages and "node 103" in messages and "shape" in messages
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert record["rejected"] == 2 and record["round"] == 1
    assert record["bytes_up"] == sum(len(v) for _, r in [good_a, garbage, good_b, wrong_shape]
                                     for v in r.metrics.values() if isinstance(v, bytes))


def test_round_fails_clearly_when_too_few_valid_updates(tmp_path):
    strategy = make_strategy(FedProtoStrategy, tmp_path, min_fit_clients=2)
    good = proto_result(0, np.ones((C, D), np.float32), np.ones(C, np.int64))
    missing = proto_result(1, np.ones((C, D), np.float32), np.ones(C, np.int64))
    del missing[1].metrics[CLASS_COUNTS]
    with pytest.raises(RunStopped) as stop:
        strategy.aggregate_fit(1, [good, missing], [RuntimeError("client crashed")])
    assert str(stop.value) == (
        "round 1: 1 of 3 client updates usable, 2 required. 1 dropped: missing 'class-counts' (1). "
        "1 failed: RuntimeError: client crashed (1). See the failed clients' logs"
    )


def ray_error_reply(line: str, message: str) -> ValueError:
    """What Flower's strategies get for a ClientApp that raised ``line`` in a Ray simulation (its
    shape copied from a run of flwr 1.42 and Ray 2.55; paths shortened)."""
    frames = "\n".join(f'  File "/venv/flwr/{name}.py", line {i}, in call\n    return x(y)\n           ^^^^' for i, name in
                       enumerate(("client_app", "message_handler", "numpy_client")))
    actor = "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=16171, ip=192.0.2.2, actor_id=062e, repr=<Actor at 0x7efe>)"
    reason = (f"<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'{actor}\n{frames}\n{line}\n\n"
              "The above exception was the direct cause of the following exception:\n\n"
              f"{actor}\n{frames}\nflwr.clientapp.client_app.ClientAppException: \n"
              f"Exception ClientAppException occurred. Message: {message}'>")
    return ValueError(f"Message contains an Error (reason: {reason}). It originated during client-side "
                      "execution of a message.")


def test_a_failed_client_is_one_line_without_the_tracebacks_ray_wraps_it_in():
    failure = ray_error_reply("OSError: [Errno 28] No space left on device: '/state/partition-3'",
                              "[Errno 28] No space left on device")
    assert describe_failure(failure) == "client error: OSError: [Errno 28] No space left on device: '/state/partition-3'"
    assert describe_failure(ValueError("Message contains an Error (reason: <class 'KeyError'>:<'x'>). It originated "
                                       "during client-side execution of a message.")) == "client error: <class 'KeyError'>:<'x'>"
    assert describe_failure(RuntimeError("client crashed")) == "RuntimeError: client crashed"


def test_a_round_whose_losses_all_diverged_names_the_cause_and_a_hint():
    dropped = [f"train-loss must be a finite number >= 0, got {value}" for value in ["nan"] * 19 + ["inf"]]
    reason = too_few_updates(2, 0, 2, dropped, [])
    assert reason.startswith("round 2: 0 of 20 client updates usable, 2 required. 20 dropped: "
                             "train-loss must be a finite number >= 0, got nan (19); "
                             "train-loss must be a finite number >= 0, got inf (1)")
    assert reason.endswith(DIVERGED_HINT)


def test_updates_must_come_from_the_node_holding_the_partition(tmp_path, caplog):
    strategy = make_strategy(FedProtoStrategy, tmp_path, min_fit_clients=1)
    good = proto_result(0, np.ones((C, D), np.float32), np.ones(C, np.int64))
    unknown = proto_result(0, np.ones((C, D), np.float32), np.ones(C, np.int64))
    unknown[1].metrics["partition-id"] = 99
    impostor = (FakeProxy("101"), proto_result(0, np.ones((C, D), np.float32), np.ones(C, np.int64))[1])
    nan_loss = proto_result(2, np.ones((C, D), np.float32), np.ones(C, np.int64), **{"train-loss": float("nan")})
    _, metrics = strategy.aggregate_fit(1, [good, unknown, impostor, nan_loss], [])
    assert metrics["accepted"] == 1
    assert "node 101" in caplog.text and "train-loss" in caplog.text


def test_fedavg_drops_non_finite_parameters_and_averages_the_rest(tmp_path):
    strategy = make_strategy(FedAvgStrategy, tmp_path)
    base = strategy.initial_weights

    def result(pid, scale, n):
        arrays = [(w * 0 + scale).astype(w.dtype) for w in base]
        return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(arrays), n,
                                                 {"partition-id": pid, "train-loss": float(scale)})

    poisoned = result(2, 1.0, 10)
    arrays = [w.copy() for w in base]
    arrays[0][0] = np.nan
    poisoned[1].parameters = ndarrays_to_parameters(arrays)
    truncated = result(3, 1.0, 10)
    truncated[1].parameters.tensors.pop()
    results = [result(0, 1.0, 10), result(1, 3.0, 30), poisoned, truncated]
    parameters, metrics = strategy.aggregate_fit(1, results, [])
    assert metrics["accepted"] == 2
    from flwr.common import parameters_to_ndarrays
    averaged = parameters_to_ndarrays(parameters)
    np.testing.assert_allclose(averaged[0], 2.5)  # (1*10 + 3*30) / 40
    assert metrics["train-loss"] == pytest.approx(2.5)


def test_personalized_metrics_aggregate_across_clients(tmp_path):
    strategy = make_strategy(FedProtoStrategy, tmp_path)
    start_round(strategy, range(5))

    def res(pid, correct, total, **extra):
        return FakeProxy(str(100 + pid)), EvaluateRes(OK, 0.5, total, {"correct": correct, **extra})

    results = [
        res(0, 9, 10, **{"correct-head": 5, "pm-l": 0.9, "pm-v": 0.5}),
        res(1, 5, 10, **{"correct-head": 5, "pm-l": 0.6, "pm-v": 0.4}),
        res(2, 0, 5, **{"correct-head": 5, "pm-l": 0.0, "pm-v": 0.0}),
    ]
    bogus = [res(3, 11, 10), res(4, 1, 10, **{"pm-l": 1.5, "pm-v": 0.5})]  # impossible values: dropped
    loss, metrics = strategy.aggregate_evaluate(1, results + bogus, [])
    assert metrics["personalized_accuracy"] == pytest.approx(14 / 25)
    assert metrics["personalized_accuracy_head"] == pytest.approx(15 / 25)
    assert metrics["personalized_worst10"] == 0.0
    # PM(L) / PM(V): unweighted over clients (FedNH's protocol), with the population std
    assert metrics["pm_l"] == pytest.approx(0.5) and metrics["pm_v"] == pytest.approx(0.3)
    assert metrics["pm_l_std"] == pytest.approx(np.std([0.9, 0.6, 0.0]))
    assert loss == pytest.approx(0.5)
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert [(d["stage"], d["partition"]) for d in record["dropped"]] == [("evaluate", 3), ("evaluate", 4)]
    assert "correct must be an integer in [0, 10], got 11" in record["dropped"][0]["reason"]


def test_evaluation_runs_every_eval_every_rounds_and_in_the_last(tmp_path):
    config = ExperimentSettings(eval_every=3, num_server_rounds=10)
    assert [r for r in range(1, 11) if config.is_eval_round(r)] == [3, 6, 9, 10]


def test_flower_logs_no_traceback_for_a_run_that_failed_after_saying_why(caplog):
    """The ServerApp raises RunFailed after its one line (tests/test_flwr_run.py: the run then ends
    failed); Flower's "raised an exception" record with its traceback is dropped for it alone."""
    from logging import ERROR

    from flwr.common.logger import log

    from protofl.server_app import RunFailed

    with caplog.at_level(ERROR, logger="flwr"):
        for error in (RunFailed("round 1: 0 of 3 client updates usable"), ValueError("a bug")):
            log(ERROR, "ServerApp raised an exception", exc_info=error)
    assert [type(record.exc_info[1]) for record in caplog.records] == [ValueError]


def test_a_run_without_usable_updates_stops_with_one_line_and_keeps_its_results(tmp_path, monkeypatch, caplog):
    from inprocess import run_in_process

    from protofl.federation.client import PrototypeClient
    from protofl.federation.wire import TRAIN_LOSS, server_round

    fit = PrototypeClient.fit

    def diverging_in_round_2(self, parameters, config):
        arrays, num_examples, metrics = fit(self, parameters, config)
        return arrays, num_examples, metrics | ({TRAIN_LOSS: float("nan")} if server_round(config) == 2 else {})

    monkeypatch.setattr(PrototypeClient, "fit", diverging_in_round_2)
    run_config = {"method": "fedavg", "num-server-rounds": 4, "local-epochs": 1, "global-test-pm": False,
                  "output-dir": str(tmp_path), "run-name": "run"}
    strategy, messages = run_in_process(run_config, num_nodes=2)  # returns: no exception escapes
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["stopped"] == (
        "round 2: 0 of 2 client updates usable, 2 required. 2 dropped: train-loss must be a finite number "
        f">= 0, got nan (2). {DIVERGED_HINT}"
    )
    assert results["rounds"][0]["global_accuracy"] > 0.3  # round 1 was kept
    assert [kind for kind, _, _ in messages].count("fit") == 4  # two rounds of two clients, then no more
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"protofl: the run stopped. {results['stopped']}"]


def test_results_record_every_method_option_at_its_value_however_the_run_was_started(tmp_path):
    """`flwr run` hands the ServerApp the method's whole table, a run config built elsewhere (the
    in-process harness, a benchmark) only the keys it sets: results.json holds every option either
    way, each at the value the run used."""
    from inprocess import run_in_process

    from protofl.strategies.fedproto import FedProtoOptions

    run_in_process({"method": "fedproto", "dataset": "digits", "num-server-rounds": 1, "fedproto.lambda": 0.5,
                    "output-dir": str(tmp_path), "run-name": "run"}, num_nodes=2)
    options = json.loads((tmp_path / "run" / "results.json").read_text())["run_config"]["options"]
    assert options == FedProtoOptions.run_config_defaults() | {"lambda": 0.5}


def test_results_record_how_each_client_computed_and_on_which_node(tmp_path):
    """results.json's client_compute: per partition, the node that replied and the known fields of
    what its client said of how it computes (a mixed cluster can be read afterwards)."""
    from inprocess import run_in_process

    run_in_process({"method": "fedproto", "dataset": "digits", "num-server-rounds": 1, "output-dir": str(tmp_path),
                    "run-name": "run"}, num_nodes=2)
    recorded = json.loads((tmp_path / "run" / "results.json").read_text())["client_compute"]
    assert sorted(recorded) == ["0", "1"]
    assert [recorded[p]["node"] for p in ("0", "1")] == ["1000", "1001"]  # the harness's node ids
    for described in recorded.values():
        assert described["device"] == "cpu" and described["training_step"] == "off"
        assert described["host"] == socket.gethostname()
        assert described["memory_format"] in ("NCHW", "channels-last") and described["autocast"] in ("off", "bf16")


@pytest.mark.parametrize("front", ["message", pytest.param("legacy", marks=pytest.mark.slow)])
def test_a_run_whose_every_node_fails_discovery_stops_naming_what_the_nodes_said(tmp_path, monkeypatch, front):
    """Nodes whose ClientApp cannot start (here: no data where they look) fail the partition query;
    the run stopped with "no client reported a partition id" and no cause. It now names the nodes'
    own error line (Ray's tracebacks taken off, as for a failed fit)."""
    from inprocess import InProcessProxy, run_in_process

    from protofl.federation import partitions

    monkeypatch.setattr(partitions, "DISCOVERY_TIMEOUT", 2.0)
    monkeypatch.setattr(partitions.PartitionDiscovery, "poll", 0.1)

    class NoData(InProcessProxy):
        def get_properties(self, ins, timeout, group_id):
            raise ray_error_reply("FileNotFoundError: data-dir /data/x does not exist",
                                  "data-dir /data/x does not exist")

    def no_data(message, context):  # the Message API: the runtime's error reply says what it raised
        raise FileNotFoundError("data-dir /data/x does not exist")

    run_config = {"method": "fedavg", "num-server-rounds": 2, "output-dir": str(tmp_path), "run-name": "run",
                  "flower-api": front}
    run_in_process(run_config, num_nodes=2, node_class=lambda p: NoData if front == "legacy" else no_data)
    stopped = json.loads((tmp_path / "run" / "results.json").read_text())["stopped"]
    assert stopped == ("round 1: no client reported a partition id; cannot sample clients. 2 nodes connected: "
                       "client error: FileNotFoundError: data-dir /data/x does not exist (2)")
