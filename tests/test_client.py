"""The client template, through FedProto's and FedAvg's hooks, on real digits data without
Flower's runtime."""

import copy

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from protofl.federation.wire import (
    CLASS_COUNTS,
    CLASS_MEANS,
    GLOBAL_PROTOTYPES,
    ArraySpec,
    ClassVectors,
    decode_array,
    encode_array,
    evaluation_as_fit_metrics,
)
from protofl.settings import ExperimentSettings
from protofl.strategies.fedavg import FedAvgClient
from protofl.strategies.fedproto import FedProtoClient
from protofl.task.data import ClientData, load_client_data
from protofl.task.models import build_model
from protofl.task.sampling import client_seed
from protofl.task.statistics import class_means
from protofl.task.weights import get_weights

CONFIG = ExperimentSettings(method="fedproto", local_epochs=1, options={"lambda": 1.0})
SPEC = CONFIG.partition_spec(4)


def make_client(cls, state, config=CONFIG, partition=1):
    data = load_client_data("digits", "", SPEC, partition)
    return cls(config, data, build_model("cnn", 1, 10, 16, seed=0), 4, state)


def prototype_config(prototypes, mask):
    return {k: encode_array(v) for k, v in ClassVectors(prototypes, mask).to_config(GLOBAL_PROTOTYPES).items()}


def test_fedproto_uploads_class_means_of_its_trained_model_and_keeps_it():
    state = RecordDict()
    client = make_client(FedProtoClient, state)
    parameters, n, metrics = client.fit([], {"server-round": 1, "seed": 3})
    assert parameters == [] and n == client.data.num_train and metrics["partition-id"] == 1
    prototypes = decode_array(metrics[CLASS_MEANS], ArraySpec((10, 512)), 1 << 24)
    counts = decode_array(metrics[CLASS_COUNTS], ArraySpec((10,), ("int64",)), 1 << 24)
    np.testing.assert_array_equal(counts, client.data.class_counts())
    features, _ = client.forward(client.data.train_x)
    expected, _ = class_means(features, client.data.train_y, 10)
    np.testing.assert_allclose(prototypes, expected, atol=1e-5)
    assert any(name.startswith("model/") for name in client.local_state)
    assert client.get_parameters({}) == []  # a personal model: no method hands it to the server

    # a new client object on the same node (next round) continues from the stored model
    trained = get_weights(client.model)
    again = make_client(FedProtoClient, state)
    again.restore_personal_model()
    for a, b in zip(trained, get_weights(again.model)):
        np.testing.assert_array_equal(a, b)


def test_fedproto_prototype_loss_pulls_features_toward_global_prototypes():
    global_prototypes = np.zeros((10, 512), np.float32)
    mask = np.ones(10, bool)
    config = {"server-round": 2, "seed": 3} | prototype_config(global_prototypes, mask)

    def feature_norm(lam):
        client = make_client(FedProtoClient, RecordDict(), ExperimentSettings(local_epochs=3, options={"lambda": lam}))
        client.fit([], config)
        features, _ = client.forward(client.data.train_x)
        return features.norm(dim=1).mean().item()

    assert feature_norm(10.0) < 0.5 * feature_norm(0.0)


def test_fedproto_evaluate_reports_prototype_and_head_predictions():
    client = make_client(FedProtoClient, RecordDict())
    _, _, metrics = client.fit([], {"server-round": 1, "seed": 3})
    prototypes = decode_array(metrics[CLASS_MEANS], ArraySpec((10, 512)), 1 << 24)
    mask = decode_array(metrics[CLASS_COUNTS], ArraySpec((10,), ("int64",)), 1 << 24) > 0
    config = prototype_config(prototypes, mask)
    _, n, result = client.evaluate([], config)
    assert n == client.data.num_test
    assert result["correct"] == result["correct-prototype"]
    features, logits = client.forward(client.data.test_x)
    distances = torch.cdist(features, torch.from_numpy(prototypes))
    distances[:, ~torch.from_numpy(mask)] = float("inf")
    assert result["correct-prototype"] == int((distances.argmin(1) == client.data.test_y).sum())
    assert result["correct-head"] == int((logits.argmax(1) == client.data.test_y).sum())


def test_fedavg_client_starts_from_the_parameters_it_receives():
    client = make_client(FedAvgClient, RecordDict(), ExperimentSettings(lr=0.0))
    received = [np.full_like(w, 0.01) for w in get_weights(client.model)]
    returned, _, _ = client.fit(received, {"seed": 1})
    for a, b in zip(received, returned):
        np.testing.assert_array_equal(a, b)  # lr 0: nothing moves


def test_node_config_num_threads_sets_torch_threads():
    import pytest
    from flwr.common import Context

    from protofl.client_app import make_client_fn

    def context(threads):
        node_config = {"partition-id": 0, "num-partitions": 3, "num-threads": threads}
        return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        make_client_fn({"dataset": "digits"})(context(1))
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="num-threads"):
            make_client_fn({"dataset": "digits"})(context(0))
    finally:
        torch.set_num_threads(before)


def test_in_a_ray_actor_the_client_takes_the_actors_cpus_as_threads_and_says_so_once(monkeypatch, caplog):
    import logging
    import sys
    import types

    from flwr.common import Context

    from protofl import client_app

    assigned = {"CPU": 1.0}
    context_of_ray = types.SimpleNamespace(get_assigned_resources=lambda: assigned)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True,
                                                                  get_runtime_context=lambda: context_of_ray))
    monkeypatch.setattr(client_app, "_announced", set())
    node_config = {"partition-id": 0, "num-partitions": 3}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with caplog.at_level(logging.INFO, logger="flwr"):
            for _ in range(2):
                client_app.make_client_fn({"dataset": "digits"})(
                    Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={}))
        assert torch.get_num_threads() == 1  # client-resources-num-cpus=1, whatever torch's default
        announced = [r.getMessage() for r in caplog.records if "protofl ClientApp" in r.getMessage()]
        assert len(announced) == 1 and "threads 1" in announced[0] and "autocast" in announced[0]
        assigned["CPU"] = 2.0
        client_app.make_client_fn({"dataset": "digits"})(
            Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={}))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_node_builds_its_family_member_or_the_architecture_its_node_config_names():
    from flwr.common import Context

    from protofl.client_app import make_client_fn

    def client(partition_id, **node_config):
        node_config = {"partition-id": partition_id, "num-partitions": 3, **node_config}
        context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
        return make_client_fn({"dataset": "digits", "method": "fedsa", "model": "htfe2"})(context).numpy_client.client

    def linear_inputs(c):
        return [m.in_features for m in c.model.body.modules() if isinstance(m, torch.nn.Linear)]

    assert linear_inputs(client(0)) == [64]  # the CNN on 16x16 digits: 64 x 1 x 1 flattened
    assert linear_inputs(client(1)) == []  # ResNet-18: convolutions and pooling only
    assert linear_inputs(client(0, model="tv-resnet18")) == []


def test_feature_sums_and_training_mode_prototypes():
    from protofl.task.statistics import FeatureSums

    seen = FeatureSums(3, 2, torch.device("cpu"))
    seen.add(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 0]))
    seen.add(torch.tensor([[5.0, 6.0]]), torch.tensor([2]))
    np.testing.assert_allclose(seen.means(), [[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]])
    assert seen.counts.tolist() == [2, 0, 1]

    # FedProto's "during-train" prototypes: the features seen while training; with lr 0 nothing
    # moves and the CNN (no BatchNorm, no dropout) gives the eval pass's means; a class whose
    # samples were never seen is filled from an eval pass ("keep": every sample is seen)
    config = ExperimentSettings(method="fedproto", local_epochs=1, lr=0.0, partial_batch="keep",
                                options={"prototype-pass": "during-train"})
    client = make_client(FedProtoClient, RecordDict(), config)
    _, _, metrics = client.fit([], {"server-round": 1, "seed": 3})
    prototypes = decode_array(metrics[CLASS_MEANS], ArraySpec((10, 512)), 1 << 24)
    expected, _ = class_means(client.forward(client.data.train_x)[0], client.data.train_y, 10)
    np.testing.assert_allclose(prototypes, expected, rtol=1e-5, atol=1e-6)
    empty = FeatureSums(10, 512, torch.device("cpu"))
    np.testing.assert_allclose(client.local_prototypes(empty), expected, rtol=1e-5, atol=1e-6)
    moved = make_client(FedProtoClient, RecordDict(), ExperimentSettings(
        method="fedproto", local_epochs=1, options={"prototype-pass": "during-train"}))
    _, _, metrics = moved.fit([], {"server-round": 1, "seed": 3})
    during = decode_array(metrics[CLASS_MEANS], ArraySpec((10, 512)), 1 << 24)
    after, _ = class_means(moved.forward(moved.data.train_x)[0], moved.data.train_y, 10)
    assert not np.allclose(during, after, atol=1e-3)  # features from before each step differ


@pytest.mark.slow  # a tv-resnet18 epoch: ~13 s each
@pytest.mark.parametrize("batchnorm_stats", ["auto", "running"])  # "running": the batch rule alone
def test_a_batchnorm_client_uploads_class_means_of_the_size_of_its_training_features(batchnorm_stats):
    """Issue 23: a skewed client of 202 CIFAR-shaped images trains tv-resnet18 for one epoch at batch
    10, lr 0.005. A last step on the two-sample remainder made its uploaded (eval-mode) class means
    8.5e15 where its training-mode ones are 19; 12 since that remainder is dropped."""
    rng = np.random.default_rng(0)
    n = 202
    labels = torch.from_numpy(rng.choice(10, n + 10, p=[0.8, 0.15, 0.05] + [0.0] * 7))
    images = torch.from_numpy((rng.integers(0, 256, (n + 10, 3, 32, 32)) / 127.5 - 1.0).astype(np.float32))
    data = ClientData(0, 10, images[:n], labels[:n], images[n:], labels[n:])
    settings = ExperimentSettings(method="fedproto", model="tv-resnet18", local_epochs=1, batch_size=10, lr=0.005,
                                  batchnorm_stats=batchnorm_stats)
    client = FedProtoClient(settings, data, build_model("tv-resnet18", 3, 10, 32, seed=0), 1, RecordDict())
    _, _, metrics = client.fit([], {"server-round": 1, "seed": 0})
    uploaded = np.linalg.norm(decode_array(metrics[CLASS_MEANS], ArraySpec((10, 512)), 1 << 24), axis=1)
    client.model.train()
    with torch.no_grad():
        features = torch.cat([client.model(x)[0] for x in data.train_x.split(10)])
    training_mode = np.linalg.norm(class_means(features, data.train_y, 10)[0], axis=1)
    assert uploaded.max() < 2 * training_mode.max()


def test_a_thread_gives_its_model_to_its_next_message_set_back_as_built():
    """One model per worker: once a message has ended (the ClientApp's mod), the thread's next
    client gets the same model with every tensor as built (FedNH's: its cosine head too), not one
    built anew; a model still in use, or of another kind, is never shared."""
    from protofl.client_app import release_worker_models, worker_model
    from protofl.strategies import build_method_model
    from protofl.task.weights import all_tensors

    settings = ExperimentSettings(dataset="digits", method="fednh")
    data = load_client_data("digits", "", settings.partition_spec(2), 0)
    built = all_tensors(build_method_model(settings, data))

    def message(work):
        return release_worker_models(None, None, lambda _message, _context: work())

    def used(model):  # a training step's traces: weights, BatchNorm statistics, gradients
        model.train()
        model(data.train_x[:8])[1].sum().backward()
        with torch.no_grad():
            for tensor in all_tensors(model).values():
                tensor.add_(1)
        return model

    def as_built(model):
        tensors = all_tensors(model)
        return tensors.keys() == built.keys() and all(torch.equal(tensors[k], v) for k, v in built.items())

    first = message(lambda: used(worker_model(settings, data, None)))
    assert not as_built(first)
    second = message(lambda: worker_model(settings, data, None))
    assert second is first and as_built(second) and all(p.grad is None for p in second.parameters())
    held = worker_model(settings, data, None)  # outside a message: in use until one ends
    assert held is first and worker_model(settings, data, None) is not held
    other = ExperimentSettings(dataset="digits", method="fednh", seed=1)
    assert message(lambda: worker_model(other, data, None)) is not held


def test_a_message_is_decoded_once_into_the_typed_round_the_hooks_read():
    """round_of: the round, this client's seed, the round's decayed learning rate, the server's arrays
    by name (and nothing else of Flower's dict), and the round whose scores ride along; scored_round:
    that round as its own evaluate message carries it."""
    settings = ExperimentSettings(method="fedproto", lr=0.1, lr_decay=0.5, seed=7)
    client = make_client(FedProtoClient, RecordDict(), settings)
    arrays = prototype_config(np.ones((10, 3), np.float32), np.ones(10, bool))
    fit = client.round_of({"server-round": 3, "seed": 11, "run-key": "r", "evaluate-round": 2} | arrays)
    assert (fit.number, fit.seed, fit.evaluates) == (3, 11, 2)
    assert fit.lr == pytest.approx(0.1 * 0.5**2)
    assert set(fit.broadcasts) == set(arrays)
    scored = client.scored_round(fit)
    evaluate = client.round_of({"server-round": 2, "seed": client_seed(7, 2, 1)} | arrays)
    assert scored == evaluate  # the same round, seed, lr and arrays as the evaluate message of round 2
    assert client.scored_round(evaluate) is evaluate
    first = client.round_of({})
    assert (first.number, first.seed, first.lr, first.evaluates, dict(first.broadcasts)) == (1, 7, 0.1, None, {})


@pytest.mark.parametrize("client_class, method", [(FedProtoClient, "fedproto"), (FedAvgClient, "fedavg")])
def test_a_fit_that_carries_the_evaluation_receives_once_and_replies_as_an_evaluate_then_a_fit(
        client_class, method, monkeypatch):
    """The previous round's scores in a fit message: receive runs once (the model scored is the one
    training starts from), and the reply is what an evaluate message and then a plain fit give."""
    settings = ExperimentSettings(method=method, local_epochs=1)
    state = RecordDict()
    trained, _, _ = make_client(client_class, state, settings).fit(
        get_weights(make_client(client_class, RecordDict(), settings).exchanged)
        if method == "fedavg" else [], {"server-round": 1, "seed": 3})
    arrays = prototype_config(np.full((10, 512), 0.1, np.float32), np.ones(10, bool)) if method == "fedproto" else {}
    parameters = trained if method == "fedavg" else []
    separate_state, carried_state = copy.deepcopy(state), copy.deepcopy(state)
    loss, num_test, scores = make_client(client_class, separate_state, settings).evaluate(
        parameters, {"server-round": 1, "seed": 4} | arrays)
    separate = make_client(client_class, separate_state, settings).fit(parameters, {"server-round": 2, "seed": 5} | arrays)
    calls = []
    receive = client_class.receive
    monkeypatch.setattr(client_class, "receive", lambda self, *a: calls.append(1) or receive(self, *a))
    carried = make_client(client_class, carried_state, settings).fit(
        parameters, {"server-round": 2, "seed": 5, "evaluate-round": 1} | arrays)
    assert len(calls) == 1
    assert carried[2] == separate[2] | evaluation_as_fit_metrics(loss, num_test, scores)
    assert carried[1] == separate[1]
    assert all(np.array_equal(a, b) for a, b in zip(carried[0], separate[0], strict=True))
