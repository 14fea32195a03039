"""Where clients score a round's model: in the next round's fit message (the default, one message per
client and round) or in a separate evaluate message; the same numbers either way, and a hostile
evaluation inside a fit reply costs only that evaluation."""

import json

import numpy as np
import pytest
from fakes import FakeProxy, start_round
from flwr.common import ndarrays_to_parameters
from inprocess import SHORT_RUN_OPTIONS, methods_fast_for, run_in_process
from test_resume import assert_same_rounds
from test_server import C, D, make_strategy, proto_result

from protofl.federation.wire import EVALUATE_ROUND
from protofl.settings import ExperimentSettings
from protofl.strategies.fedproto import FedProtoStrategy

# batch-size 32: a third of the default's steps; where the scores travel does not depend on it
RUN = {"dataset": "digits", "num-server-rounds": 3, "local-epochs": 1, "global-test-pm": True,
       "global-test-pm-per-class": 10, "batch-size": 32, **SHORT_RUN_OPTIONS}


def kinds(messages):
    return [kind for kind, _, _ in messages if kind in ("fit", "evaluate")]


# fast: FedProto (personal models, prototypes); CI runs every method
@pytest.mark.parametrize("method", methods_fast_for("fedproto"))
def test_scores_in_the_fit_message_equal_those_of_a_separate_evaluate_message(tmp_path, method):
    config = RUN | {"method": method, "output-dir": str(tmp_path)}
    _, in_fit = run_in_process(config | {"run-name": "fit"}, num_nodes=3)
    _, separate = run_in_process(config | {"run-name": "evaluate", "evaluation-message": "evaluate"}, num_nodes=3)
    # one message per client and round; the last round's scores need one more
    assert kinds(in_fit) == ["fit"] * 9 + ["evaluate"] * 3
    assert kinds(separate) == (["fit"] * 3 + ["evaluate"] * 3) * 3
    asked = [ins.config.get(EVALUATE_ROUND) for kind, ins, _ in in_fit if kind == "fit"]
    assert asked == [None] * 3 + [1] * 3 + [2] * 3
    rounds = json.loads((tmp_path / "fit" / "results.json").read_text())["rounds"]
    assert all(r["personalized_accuracy"] is not None and "pm_l" in r for r in rounds)
    assert_same_rounds(tmp_path / "fit", tmp_path / "evaluate")  # the same numbers, round by round


def test_with_fewer_clients_per_round_scores_keep_their_own_message(tmp_path):
    """The next round trains another sample than the one to score: a fit message cannot carry it."""
    config = RUN | {"method": "fedavg", "output-dir": str(tmp_path), "run-name": "r", "fraction-fit": 0.5}
    _, messages = run_in_process(config, num_nodes=4)
    assert kinds(messages) == (["fit"] * 2 + ["evaluate"] * 2) * 3
    assert not ExperimentSettings(fraction_fit=0.5).evaluates_in_next_fit(1)
    assert ExperimentSettings().evaluates_in_next_fit(1) and not ExperimentSettings(num_server_rounds=1)\
        .evaluates_in_next_fit(1)


def test_a_bad_evaluation_in_a_fit_reply_is_dropped_and_the_update_kept(tmp_path, caplog):
    strategy = make_strategy(FedProtoStrategy, tmp_path)
    strategy.evaluation.pending = 1  # round 1's scores ride in round 2's fit replies
    counts = np.array([5] + [0] * 9)
    prototypes = np.ones((C, D), np.float32)
    good = proto_result(0, prototypes, counts, **{"evaluated-correct": 3, "evaluated-loss": 0.5,
                                                  "evaluated-num-examples": 4})
    lying = proto_result(1, prototypes, counts, **{"evaluated-correct": 9, "evaluated-loss": 0.5,
                                                   "evaluated-num-examples": 4})
    nan_loss = proto_result(2, prototypes, counts, **{"evaluated-correct": 1, "evaluated-loss": float("nan"),
                                                      "evaluated-num-examples": 4})
    silent = proto_result(3, prototypes, counts)  # asked to score, sent nothing
    _, metrics = strategy.aggregate_fit(2, [good, lying, nan_loss, silent], [])
    assert metrics["accepted"] == 4 and strategy.evaluation.pending is None
    rounds = {r["round"]: r for r in json.loads((tmp_path / "run" / "results.json").read_text())["rounds"]}
    assert rounds[1]["personalized_accuracy"] == pytest.approx(3 / 4)  # only the good one
    assert [(d["stage"], d["partition"]) for d in rounds[1]["dropped"]] == [("evaluate", p) for p in (1, 2, 3)]
    assert "evaluated" not in json.dumps(rounds[2]) and rounds[2]["dropped"] == []
    assert "correct must be an integer in [0, 4], got 9" in rounds[1]["dropped"][0]["reason"]


def test_evaluation_keys_nobody_asked_for_are_ignored(tmp_path):
    strategy = make_strategy(FedProtoStrategy, tmp_path, min_fit_clients=1)
    pushy = proto_result(0, np.ones((C, D), np.float32), np.ones(C, np.int64), **{"evaluated-correct": 1})
    _, metrics = strategy.aggregate_fit(1, [pushy], [])
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert metrics["accepted"] == 1 and record["personalized_accuracy"] is None and record["dropped"] == []


def test_the_fit_config_asks_for_the_pending_round_and_a_checkpoint_keeps_it(tmp_path):
    strategy = make_strategy(FedProtoStrategy, tmp_path, num_server_rounds=3)
    parameters = ndarrays_to_parameters([])
    assert strategy.configure_evaluate(1, parameters, None) == [] and strategy.evaluation.pending == 1
    assert strategy.server_state()["pending_evaluation"] == 1

    class Nodes:
        def all(self):
            return {str(100 + p): FakeProxy(str(100 + p)) for p in range(4)}

    strategy.discovery.discover = lambda client_manager, query=None: start_round(strategy, range(4))
    configs = [ins.config for _, ins in strategy.configure_fit(2, parameters, Nodes())]
    assert [c[EVALUATE_ROUND] for c in configs] == [1] * 4
    assert len(strategy.configure_evaluate(3, parameters, None)) == 4  # the last round: its own message
