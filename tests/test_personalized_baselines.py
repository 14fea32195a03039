"""The baselines of FedNH's Table 1 (Local, FedPer, FedRep, FedBABU, FedRoD, Ditto, CReFF): their
math on hand-checked numbers, what each client keeps and scores, and what each server scores as GM.
Their option checks are in tests/test_baselines.py, their agreement with FedNH's code in
tests/test_conformance_fednh_baselines.py and tests/test_conformance_creff.py."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict
from test_baselines import BATCH, BIG, FIT, make_client
from torch import nn

from protofl.federation.wire import ArraySpec, decode_array, encode_array, indexed
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.creff import (
    classifier_gradients,
    gradient_distance,
    match_features,
    per_class_gradients,
    retrain_classifier,
)
from protofl.strategies.fedrod import balanced_softmax_loss, label_distribution
from protofl.task.data import load_client_data, load_dataset
from protofl.task.models import build_model, trainable_only
from protofl.task.server_training import minibatch_sgd, shuffles
from protofl.task.weights import get_weights


# --- the math on hand-checked numbers -----------------------------------------------------


def test_balanced_softmax_shifts_the_logits_by_the_log_label_shares():
    distribution = label_distribution(np.array([3, 1]))
    assert distribution.tolist() == [0.75, 0.25]
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    # logits 0 + log p: softmax = p, so the loss of label y is -log p(y)
    assert balanced_softmax_loss(zeros, torch.tensor([1]), distribution).item() == pytest.approx(-math.log(0.25))
    assert balanced_softmax_loss(zeros, torch.tensor([0]), distribution).item() == pytest.approx(-math.log(0.75))
    # uniform shares: the plain cross-entropy
    logits = torch.tensor([[0.3, -1.2]], dtype=torch.float64)
    uniform = label_distribution(np.array([5, 5]))
    assert balanced_softmax_loss(logits, torch.tensor([1]), uniform).item() == pytest.approx(
        F.cross_entropy(logits, torch.tensor([1])).item())


def test_a_class_the_client_lacks_gets_a_tiny_share():
    distribution = label_distribution(np.array([3, 1, 0]))
    assert distribution[2].item() == pytest.approx(1e-12 / 4) and distribution.sum().item() == pytest.approx(1.0)


def test_gradient_distance_is_one_minus_the_cosine_per_row():
    real = [torch.tensor([[[1.0, 0.0], [0.0, 2.0]]]), torch.tensor([[1.0, 1.0]])]  # a weight (2 rows), a bias
    same = [t * 3 for t in real]
    opposite = [-t for t in real]
    orthogonal = [torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), torch.tensor([[1.0, -1.0]])]
    assert gradient_distance(same, real).item() == pytest.approx(0.0, abs=1e-5)  # 1e-6 in the denominator
    assert gradient_distance(opposite, real).item() == pytest.approx(6.0, abs=1e-5)  # 3 rows, 1 - (-1) each
    assert gradient_distance(orthogonal, real).item() == pytest.approx(3.0, abs=1e-5)


def test_the_closed_form_class_gradients_equal_autograds():
    torch.manual_seed(0)
    features = torch.randn(5, 4, dtype=torch.float64)
    weight, bias = torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64,
                                                                                           requires_grad=True)
    loss = F.cross_entropy(F.linear(features, weight, bias), torch.full((5,), 2))
    expected = torch.autograd.grad(loss, [weight, bias])
    for ours, theirs in zip(classifier_gradients(features, 2, [weight, bias]), expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    grouped = per_class_gradients(features.reshape(1, 5, 4), torch.full((1, 5), 2), [weight.detach(), bias.detach()])
    torch.testing.assert_close(grouped[0][0], expected[0], rtol=1e-12, atol=1e-14)


def test_matching_moves_only_the_classes_sent_and_brings_their_gradients_closer():
    torch.manual_seed(1)
    features = torch.randn(3, 8, 4, dtype=torch.float64)
    classifier = [torch.randn(3, 4, dtype=torch.float64)]
    real = {1: classifier_gradients(torch.rand(6, 4, dtype=torch.float64) + 1, 1, classifier)}
    matched = match_features(features, classifier, real, epochs=50, lr=0.5)
    assert torch.equal(matched[0], features[0]) and torch.equal(matched[2], features[2])

    def distance(f):
        synthetic = classifier_gradients(f[1], 1, classifier)
        return gradient_distance([g.unsqueeze(0) for g in synthetic], [g.unsqueeze(0) for g in real[1]]).item()

    assert distance(matched) < 0.5 * distance(features)


def test_the_retrained_classifier_separates_the_federated_features():
    torch.manual_seed(2)
    centres = torch.eye(3, 6, dtype=torch.float64) * 4
    features = centres.unsqueeze(1) + 0.1 * torch.randn(3, 20, 6, dtype=torch.float64)
    classifier = nn.Linear(6, 3, dtype=torch.float64)
    retrain_classifier(classifier, features, epochs=30, lr=0.5, batch_size=16,
                       orders=shuffles(60, torch.Generator().manual_seed(0)))
    predicted = classifier(features.reshape(-1, 6)).argmax(1)
    assert torch.equal(predicted, torch.arange(3).repeat_interleave(20))


def test_trainable_only_makes_exactly_those_trainable_and_puts_the_flags_back():
    model = build_model("cnn", 1, 10, 16, seed=0)
    model.head.weight.requires_grad_(False)
    with trainable_only(model, [model.head.weight]):
        assert [name for name, p in model.named_parameters() if p.requires_grad] == ["head.weight"]
    assert not model.head.weight.requires_grad and model.head.bias.requires_grad
    with pytest.raises(RuntimeError), trainable_only(model, []):
        raise RuntimeError
    assert model.head.bias.requires_grad



@pytest.mark.parametrize("threads", [2, 3])
def test_server_training_steps_on_one_thread_and_gives_the_thread_count_back(threads):
    """Server training's small steps run on one CPU thread (task/server_training.py), and the
    caller's count is back afterwards, after a failure too; the steps are plain SGD: w = 0, loss
    (w - 1)^2 over one sample per batch, lr 0.25: each step halves the distance to 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seen, weight = [], torch.zeros(1, dtype=torch.float64, requires_grad=True)

        def loss(batch):
            seen.append(torch.get_num_threads())
            return ((weight - 1) ** 2).sum() * len(batch)

        minibatch_sgd([weight], loss, 3, 1, 1, 0.25, shuffles(3, torch.Generator().manual_seed(0)))
        assert seen == [1, 1, 1] and weight.item() == 1 - 0.5 ** 3
        assert torch.get_num_threads() == threads

        def failing(batch):
            raise FloatingPointError

        with pytest.raises(FloatingPointError):
            minibatch_sgd([weight], failing, 3, 1, 1, 0.25, shuffles(3, torch.Generator().manual_seed(0)))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)

# --- clients and servers on digits ----------------------------------------------------------


@pytest.fixture(scope="module")
def data():
    return load_client_data("digits", "", ExperimentSettings(batch_size=BATCH).partition_spec(2), 0)


def make(method, data, state=None, **options):
    return make_client(get_method(method)[1], method, data, state, **options)


def shared_of(client):
    return [a.copy() for a in client.shared_arrays()]


def state_of(client):
    return {k: v.detach().clone() for k, v in client.model.state_dict().items()}


def test_fedbabu_trains_the_body_under_the_frozen_initial_head_and_fine_tunes_only_to_score(data):
    client = make("fedbabu", data, **{"finetune-epochs": 1})
    initial = state_of(client)
    assert [n for n in client.shared_names if n.startswith("head.")] == []
    client.fit(shared_of(client), dict(FIT))
    trained = state_of(client)
    assert torch.equal(trained["head.weight"], initial["head.weight"])
    assert not torch.equal(trained["body.0.0.weight"], initial["body.0.0.weight"])
    fine_tuned = {}
    original = client.score

    def spy(predictors):
        fine_tuned.update(state_of(client))
        return original(predictors)

    client.score = spy
    client.evaluate(shared_of(client), dict(FIT))
    assert not torch.equal(fine_tuned["head.weight"], initial["head.weight"])  # fine-tuned to score
    assert not client.model.head.weight.requires_grad  # and frozen again
    untuned = make("fedbabu", data, **{"finetune-epochs": 0})
    untuned.score = lambda predictors: fine_tuned.update(untuned_state=state_of(untuned))
    untuned.evaluate(shared_of(client), dict(FIT))
    assert torch.equal(fine_tuned["untuned_state"]["head.weight"], initial["head.weight"])


def test_fedper_keeps_its_head_and_scores_it_on_the_global_body(data):
    state = RecordDict()
    client = make("fedper", data, state)
    received = shared_of(client)
    client.fit(received, dict(FIT))
    trained_head = client.model.head.weight.detach().clone()
    again = make("fedper", data, state)  # the next message: a new client object, the node's state
    scored = {}
    again.score = lambda predictors: scored.update(state_of(again))
    again.evaluate(received, dict(FIT))
    assert torch.equal(scored["head.weight"], trained_head)  # its own head
    np.testing.assert_array_equal(scored["body.0.0.weight"].numpy(), received[0])  # on the global body


def test_ditto_keeps_a_personal_model_beside_the_global_one(data):
    state = RecordDict()
    client = make("ditto", data, state)
    received = shared_of(client)
    global_after, _, metrics = client.fit(received, dict(FIT))
    personal = client.stored_model("personal/")
    assert personal and not np.array_equal(personal["body.0.0.weight"], global_after[0])
    assert metrics["proximal-loss"] > 0
    again = make("ditto", data, state)
    scored = {}
    again.score = lambda predictors: scored.update(state_of(again))
    again.evaluate(received, dict(FIT))
    np.testing.assert_array_equal(scored["body.0.0.weight"].numpy(), personal["body.0.0.weight"])  # PM: v


@pytest.mark.parametrize("method", ["fedper", "fedrep", "fedbabu", "fedrod"])
def test_gm_is_the_global_body_with_the_initial_head(method):
    settings = ExperimentSettings(method=method)
    model = build_method_model(settings, load_dataset("digits"))
    strategy = get_method(method)[0](settings, model, 10)
    shared = [a + 1 for a in strategy.shared_weights()]
    weights = strategy.global_model_weights(shared)
    names = list(model.state_dict())
    assert len(weights) == len(names)
    for name, value, initial in zip(names, weights, strategy.initial_weights):
        expected = initial if not strategy.options.shares(name) else initial + 1
        np.testing.assert_array_equal(value, expected)
    assert any(not strategy.options.shares(n) for n in names)


def test_local_has_no_gm_and_creffs_gm_carries_the_retrained_classifier():
    local = get_method("local")[0](ExperimentSettings(method="local"), build_model("cnn", 1, 10, 16, seed=0), 10)
    assert local.shared_weights() == [] and local.global_model_weights([]) is None
    settings = ExperimentSettings(method="creff")
    model = build_method_model(settings, load_dataset("digits"))
    creff = get_method("creff")[0](settings, model, 10)
    weights = creff.global_model_weights(creff.shared_weights())
    names = list(model.state_dict())
    np.testing.assert_array_equal(weights[names.index("head.weight")], creff.classifier[0])
    np.testing.assert_array_equal(weights[names.index("head.bias")], creff.classifier[1])
    np.testing.assert_array_equal(weights[0], get_weights(model)[0])


def test_creff_uploads_class_gradients_for_the_classes_it_holds(data):
    client = make("creff", data)
    config = dict(FIT) | {k: encode_array(v) for k, v in indexed(
        "creff-classifier", [p.detach().numpy() for p in client.model.head.parameters()]).items()}
    _, _, metrics = client.fit(shared_of(client), config)
    held = decode_array(metrics["gradient-classes"], ArraySpec((10,), ("bool",)), BIG)
    np.testing.assert_array_equal(held, data.class_counts() > 0)
    gradients = decode_array(metrics["class-gradients/0"], ArraySpec((10, None, None)), BIG)
    assert gradients.shape == (10, *client.model.head.weight.shape)
    assert (np.abs(gradients[~held]).sum() == 0) and (np.abs(gradients[held]).sum(axis=(1, 2)) > 0).all()
