"""The template hooks that methods beyond FedProto's shape need: local training in phases, a task loss
of the method's own, gradient offsets, a module and its optimizer trained on the server and kept in
the checkpoint, a broadcast per client, and results.json's record of every "auto" setting."""

import copy
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from inprocess import run_in_process
from test_resume import RUN, assert_same_rounds
from toy_methods import BalancedSoftmaxClient, OwnBroadcastStrategy, ServerHeadStrategy, registered

from protofl.federation.checkpoint import Checkpoint
from protofl.federation.client import PrototypeClient
from protofl.federation.server import legacy_strategy
from protofl.federation.server_state import MethodState
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.task.data import load_client_data, load_dataset
from protofl.task.weights import get_weights


def digits_client(client_class, **settings):
    config = ExperimentSettings(dataset="digits", batch_size=32, local_epochs=1, **settings)
    data = load_client_data("digits", "", config.partition_spec(2), 0)
    return client_class(config, data, build_method_model(config, data), 2, RecordDict())


# --- the client's local training ------------------------------------------------------------------


class HeadThenBody(PrototypeClient):
    """FedRep's shape: the head for an epoch with the body frozen, then the body with the head frozen."""

    def local_training(self, this_round):
        self.model.body.requires_grad_(False)
        self.head_loss = self.train_model(this_round, phase="head")
        self.after_head = copy.deepcopy(self.model)
        self.model.body.requires_grad_(True)
        self.model.head.requires_grad_(False)
        loss = self.train_model(this_round, phase="body", epochs=2)
        self.model.head.requires_grad_(True)
        return loss


def test_a_client_trains_in_phases_each_on_the_parameters_it_leaves_trainable():
    client = digits_client(HeadThenBody)
    before = copy.deepcopy(client.model)
    _, _, metrics = client.fit(client.get_parameters({}), {"server-round": 1, "seed": 3})
    unchanged = lambda a, b: all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))  # noqa: E731
    assert unchanged(client.after_head.body, before.body) and not unchanged(client.after_head.head, before.head)
    assert unchanged(client.model.head, client.after_head.head) and not unchanged(client.model.body, before.body)
    assert metrics["train-loss"] != client.head_loss  # the body phase's loss is what goes up


class NoTaskLoss(PrototypeClient):
    def classification_loss(self, logits, labels):
        return 0.0 * logits.sum()


class DriftByOffsets(NoTaskLoss):
    def gradient_offsets(self):
        return {name: torch.full_like(p, 0.5) for name, p in self.model.named_parameters()}


def test_a_method_replaces_the_task_loss_and_offsets_the_gradients():
    still = digits_client(NoTaskLoss)
    start = get_weights(still.model)
    still.fit(still.get_parameters({}), {"server-round": 1, "seed": 3})
    assert all(np.array_equal(a, b) for a, b in zip(get_weights(still.model), start))  # no loss: no step

    drifting = digits_client(DriftByOffsets, lr=0.1)
    drifting.fit(drifting.get_parameters({}), {"server-round": 1, "seed": 3})
    steps = drifting.steps_per_epoch()
    for after, before in zip(get_weights(drifting.model), start):  # each step: w <- w - lr * 0.5
        np.testing.assert_allclose(after, before - steps * 0.1 * 0.5, rtol=0, atol=1e-5)


def test_a_task_loss_of_its_own_trains_on_what_it_computes():
    """The balanced softmax shifts the logits by the log class prior: with a uniform prior (a constant
    shift) it is the cross-entropy exactly; with the client's skewed prior it trains another model."""
    plain, balanced = digits_client(PrototypeClient), digits_client(BalancedSoftmaxClient)
    for client in (plain, balanced):
        client.fit(client.get_parameters({}), {"server-round": 1, "seed": 3})
    assert not all(np.array_equal(a, b) for a, b in zip(get_weights(plain.model), get_weights(balanced.model)))

    class UniformPrior(BalancedSoftmaxClient):
        def receive(self, parameters, this_round):
            super().receive(parameters, this_round)
            self.log_prior = torch.full_like(self.log_prior, np.log(0.1))

    uniform = digits_client(UniformPrior)
    uniform.fit(uniform.get_parameters({}), {"server-round": 1, "seed": 3})
    for a, b in zip(get_weights(plain.model), get_weights(uniform.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 softmax of shifted logits


# --- state kept on the server ----------------------------------------------------------------------


def test_a_module_and_its_optimizer_round_trip_through_a_checkpoint_and_a_snapshot(tmp_path):
    with registered():
        settings = ExperimentSettings(method="server-head", dataset="digits", output_dir=str(tmp_path), run_name="r")
        strategy = legacy_strategy(ServerHeadStrategy)(settings, build_method_model(settings, load_dataset("digits")), 10)
    strategy.head(torch.randn(4, strategy.feature_dim)).sum().backward()
    strategy.optimizer.step()  # momentum buffers now exist
    state = MethodState(strategy, strategy.state_fields)
    checkpoint = Checkpoint(1, [], {"fields": state.checkpointed()}, {}, "token")
    restored = Checkpoint.from_bytes(checkpoint.to_bytes()).strategy_state["fields"]
    snapshot = state.snapshot()
    head, momentum = copy.deepcopy(strategy.head.state_dict()), copy.deepcopy(strategy.optimizer.state_dict())
    for p in strategy.head.parameters():  # another step changes the module and the optimizer's state
        p.grad = torch.ones_like(p)
    strategy.optimizer.step()
    state.restore(snapshot)
    assert all(torch.equal(strategy.head.state_dict()[k], v) for k, v in head.items())
    state.restore(restored)  # from the checkpoint's bytes: the same values, the optimizer on the module's own tensors
    assert all(torch.equal(strategy.head.state_dict()[k], v) for k, v in head.items())
    buffers = strategy.optimizer.state_dict()["state"]
    assert all(torch.equal(buffers[i]["momentum_buffer"], s["momentum_buffer"]) for i, s in momentum["state"].items())
    assert strategy.optimizer.param_groups[0]["params"] == list(strategy.head.parameters())


def test_a_snapshot_shares_read_only_arrays_and_copies_the_rest():
    """A snapshot before the rule must survive what the rule does in place: a writeable array is
    copied; a read-only one (FedAMP's held models) cannot change in place and is shared, not copied."""
    frozen, live = np.arange(3.0), np.arange(3.0)
    frozen.setflags(write=False)
    owner = SimpleNamespace(models={0: [frozen, live]}, pair=(frozen, live))
    snapshot = MethodState(owner, ["models", "pair"]).snapshot()
    assert snapshot["models"][0][0] is frozen and snapshot["pair"][0] is frozen
    live += 1  # the rule changes a writeable array in place
    np.testing.assert_array_equal(snapshot["models"][0][1], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(snapshot["pair"][1], [0.0, 1.0, 2.0])
    assert type(snapshot["pair"]) is tuple and snapshot["models"] is not owner.models


def test_a_run_whose_server_trains_a_module_resumes_as_if_never_stopped(tmp_path):
    config = RUN | {"method": "server-head", "output-dir": str(tmp_path), "fraction-fit": 1.0}
    with registered():
        whole, _ = run_in_process(config | {"run-name": "whole"}, num_nodes=3)
        run_in_process(config | {"run-name": "parts", "num-server-rounds": 2}, num_nodes=3)
        parts, _ = run_in_process(config | {"run-name": "parts", "resume": True}, num_nodes=3)
    assert_same_rounds(tmp_path / "parts", tmp_path / "whole")
    assert all(torch.equal(a, b) for a, b in zip(parts.head.state_dict().values(), whole.head.state_dict().values()))
    assert parts.optimizer.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0


def sent_own_arrays(messages) -> list[np.ndarray]:
    return [np.load(io.BytesIO(ins.config["own-array"])) for kind, ins, _ in messages
            if kind in ("fit", "evaluate") and "own-array" in ins.config]


def test_each_client_receives_its_own_broadcast_and_a_non_finite_one_never_goes_out(tmp_path, monkeypatch):
    config = RUN | {"method": "own-broadcast", "output-dir": str(tmp_path), "fraction-fit": 1.0,
                    "num-server-rounds": 3}
    with registered():
        _, messages = run_in_process(config | {"run-name": "own"}, num_nodes=3)  # a client refuses another's array
        rounds = json.loads((tmp_path / "own" / "results.json").read_text())["rounds"]
        assert [r["clients"] for r in rounds] == [[0, 1, 2]] * 3 and not any(r["dropped"] for r in rounds)
        monkeypatch.setattr(OwnBroadcastStrategy, "poisoned", {1})  # the rule makes partition 1's array non-finite
        _, messages = run_in_process(config | {"run-name": "poisoned"}, num_nodes=3)
        rounds = json.loads((tmp_path / "poisoned" / "results.json").read_text())["rounds"]
        assert all("'1:own-array' is not finite" in r["kept_previous"] for r in rounds)  # the rule's state kept
        assert sent_own_arrays(messages) and all(np.isfinite(a).all() for a in sent_own_arrays(messages))
        monkeypatch.setattr(OwnBroadcastStrategy, "broken", True)  # non-finite whatever the rule's state
        _, messages = run_in_process(config | {"run-name": "broken"}, num_nodes=3)
    results = json.loads((tmp_path / "broken" / "results.json").read_text())
    assert results["stopped"] == "round 2: the broadcast '0:own-array' is not finite, so it is not sent"
    assert all(np.isfinite(a).all() for a in sent_own_arrays(messages))


# --- results.json: what ran --------------------------------------------------------------------------


@pytest.mark.parametrize("method, options, resolved", [
    ("fednh", {}, {"max-grad-norm": 10.0}),
    ("fedsa", {}, {"max-grad-norm": 0.0, "fedsa.lambda-mcl": 0.01}),
    ("fedopt", {"fedopt.optimizer": "yogi"}, {"fedopt.eta": 1.0, "fedopt.tau": 0.1}),
    ("fedopt", {"fedopt.eta": 0.5}, {"fedopt.tau": 0.1}),
])
def test_results_record_what_each_auto_setting_resolved_to(tmp_path, method, options, resolved):
    config = RUN | {"method": method, "num-server-rounds": 1, "output-dir": str(tmp_path), "run-name": "r"} | options
    run_in_process(config, num_nodes=2)
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["resolved"].items() >= resolved.items()
    assert {"amp", "channels-last", "cuda-graphs"} <= set(results["resolved"])  # auto by default
    if method == "fedopt" and "fedopt.eta" in options:
        assert "fedopt.eta" not in results["resolved"]  # a value given is not "auto"
    compute = next(iter(results["client_compute"].values()))
    assert compute["batchnorm_stats"] == "running"  # the CNN has no BatchNorm to recompute
