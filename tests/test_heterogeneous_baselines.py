"""FedSA's baselines (LG-FedAvg, FedDistill, FML, FedKD, FedGen, FedTGP, FedGH): their math on
hand-checked numbers, and what they exchange with clients of different architectures (a model
family). Against HtFLlib's code: tests/test_conformance_htfllib_*.py."""

import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from protofl.federation.admission import ClientUpdate
from protofl.federation.wire import SEED, SERVER_ROUND, PayloadError
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.families.second_model import MutualModels
from protofl.strategies.feddistill import distillation_loss
from protofl.strategies.fedgen import LABEL_COUNTS, Generator, draw, generator_entries
from protofl.strategies.fedkd import FedKDOptions, factor_form, from_factor_form, low_rank
from protofl.strategies.fedtgp import adaptive_margin, margin_loss
from protofl.task.data import load_client_data, load_dataset
from protofl.task.losses import mean_kl
from protofl.task.models import SplitModel
from protofl.task.prototypes import prototype_pairs
from protofl.task.train import train

SHARES_ACROSS = ("lgfedavg", "fml", "fedkd", "fedgen", "fedgh")  # parameters, but the same for every architecture


# --- the math ---------------------------------------------------------------------------------


def test_low_rank_keeps_the_fewest_singular_values_above_the_energy_and_all_when_only_all_are():
    matrix = np.diag([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert np.array_equal(low_rank(matrix, 0.5), np.diag([3.0, 0, 0]))  # 9 > 7
    assert np.allclose(low_rank(matrix, 0.9), np.diag([3.0, 2.0, 0]))  # 9 <= 12.6 < 13
    assert np.allclose(low_rank(matrix, 0.95), matrix)  # 13 <= 13.3: only all three (HtFLlib's code: zeros)
    kernels = np.stack([np.diag([3.0, 2.0, 1.0]), np.diag([1.0, 0.0, 0.0])])[:, None]  # 2 x 1 x 3 x 3: one rank
    assert np.allclose(low_rank(kernels, 0.6), np.stack([np.diag([3.0, 0, 0]), np.diag([1.0, 0, 0])])[:, None])
    for unchanged in (np.arange(3.0), np.ones((1, 4)), np.zeros((3, 3))):  # a bias, one row, no energy
        assert low_rank(unchanged, 0.5) is unchanged


def test_factor_form_is_a_matrixs_factors_where_they_are_fewer_and_reads_back_as_low_rank():
    rng = np.random.default_rng(0)

    def near_rank_one(*shape):  # each matrix u v^T and a little noise: rank 1 at T = 0.9
        u, v = rng.normal(size=(*shape[:-1], 1)), rng.normal(size=(*shape[:-2], 1, shape[-1]))
        return (u @ v + 1e-3 * rng.normal(size=shape)).astype(np.float32)

    for array, sent_shape in ((near_rank_one(6, 10), (16,)), (near_rank_one(4, 3, 5, 5), (4, 3, 10))):
        sent = factor_form(array, 0.9)  # 1 x (6 + 10) numbers for 60; a kernel's 1 x (5 + 5) for 25
        assert sent.shape == sent_shape and sent.dtype == np.float32
        assert np.array_equal(from_factor_form(sent, array.shape), low_rank(array, 0.9))
    matrix = np.diag([3.0, 2.0, 1.0])  # rank 2 at T = 0.9: 2 x (3 + 3) = 12 numbers for 9, so the matrix
    assert np.array_equal(factor_form(matrix, 0.9), low_rank(matrix, 0.9))
    assert np.array_equal(from_factor_form(factor_form(matrix, 0.9), (3, 3)), low_rank(matrix, 0.9))
    bias = np.arange(3.0)
    assert factor_form(bias, 0.5) is bias and from_factor_form(bias, (3,)) is bias


@pytest.mark.parametrize("sent, shape", [
    (np.ones(0), (6, 10)), (np.ones(15), (6, 10)), (np.ones(16 * 7), (6, 10)),  # rank 0, 15/16, 7 > min(6, 10)
    (np.ones((4, 2, 10)), (4, 3, 5, 5)), (np.ones((6, 11)), (6, 10)),  # other batch axes; another matrix
    (np.full(16, 1e30, np.float32), (6, 10)),  # finite factors, an infinite product
])
def test_from_factor_form_refuses_what_no_factors_of_the_entry_make(sent, shape):
    with pytest.raises(PayloadError):
        from_factor_form(sent, shape)


def test_a_fedkd_client_uploads_its_mentees_factors_which_the_server_reads_back(digits, tmp_path):
    settings = ExperimentSettings(method="fedkd", dataset="digits", output_dir=str(tmp_path))
    strategy_class, client_class = get_method("fedkd")
    strategy = strategy_class(settings, build_method_model(settings, digits), 10)
    data = client_data(0)
    client = client_class(settings, data, build_method_model(settings, data), 2, RecordDict())
    sent, _, _ = client.fit(strategy.shared_weights(), {SERVER_ROUND: 1, SEED: 0})
    trained = client.shared_arrays()  # the mentee as trained, before Eq. 7-8
    assert sum(a.nbytes for a in sent) < sum(a.nbytes for a in trained)  # its head as factors, at least
    for i, (received, array) in enumerate(zip(strategy.parameters_from_wire(sent), trained)):
        assert np.array_equal(received, low_rank(array, 0.95) if strategy.compressed(i) else array)


def test_fedkd_energy_rises_linearly_from_start_to_end_over_its_rounds_then_stays():
    options = FedKDOptions(energy_rounds=4)
    assert [options.energy(r) for r in (1, 3, 5, 9)] == pytest.approx([0.95, 0.965, 0.98, 0.98])


def test_the_adaptive_margin_is_the_largest_nearest_class_distance_capped():
    means, mask = np.array([[0.0, 0], [3, 0], [0, 4], [9, 9]]), np.array([True, True, True, False])
    assert adaptive_margin(means, mask, 100.0) == 4.0  # gaps 3, 3, 4; class 3 uploaded by nobody
    assert adaptive_margin(means, mask, 2.5) == 2.5
    assert adaptive_margin(means, np.array([True, False, False, False]), 7.0) == 7.0  # one class: the cap


def test_the_margin_loss_adds_the_margin_to_the_distance_of_the_own_class():
    centres = torch.tensor([[0.0, 0], [3, 4]], dtype=torch.float64)
    loss = margin_loss(torch.zeros(1, 2, dtype=torch.float64), torch.tensor([0]), centres, 1.0)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-4)))  # logits -(0 + 1), -5


def test_distillation_targets_the_global_logit_raw_or_softmaxed_and_else_the_own():
    logits = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)  # p = 0.75, 0.25
    global_logits = torch.tensor([[2.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    label, yes, no = torch.tensor([0]), torch.tensor([True, True]), torch.tensor([False, True])
    raw = distillation_loss(logits, label, global_logits, yes)
    assert float(raw) == pytest.approx(-2 * math.log(0.75) + math.log(0.25))  # targets 2, -1 as they are
    soft = distillation_loss(logits, label, global_logits, yes, softmax_target=True)
    q = np.exp([2.0, -1.0]) / np.exp([2.0, -1.0]).sum()
    assert float(soft) == pytest.approx(-(q[0] * math.log(0.75) + q[1] * math.log(0.25)))
    own = distillation_loss(logits, label, global_logits, no)  # class 0 has no global logit
    assert float(own) == pytest.approx(-math.log(3.0) * math.log(0.75))


def test_mean_kl_averages_over_the_batch_and_the_classes():
    p_logits = torch.zeros(1, 2, dtype=torch.float64)  # 0.5, 0.5
    q_logits = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)  # 0.75, 0.25
    assert float(mean_kl(p_logits, q_logits)) == pytest.approx((0.75 * math.log(1.5) + 0.25 * math.log(0.5)) / 2)
    assert float(mean_kl(q_logits, q_logits)) == pytest.approx(0.0, abs=1e-15)


def test_prototype_pairs_take_each_clients_held_classes_in_order():
    means = np.arange(2 * 3 * 1, dtype=np.float32).reshape(2, 3, 1)
    prototypes, labels = prototype_pairs(means, np.array([[1, 0, 2], [0, 3, 0]]))
    assert labels.tolist() == [0, 2, 1] and prototypes[:, 0].tolist() == [0.0, 2.0, 4.0]


def test_generated_labels_come_only_from_classes_with_samples():
    generator = Generator(4, 3, 8, 5).double()
    labels, features = draw(generator, torch.tensor([0.0, 5.0, 1.0], dtype=torch.float64), 200, 4,
                            torch.Generator().manual_seed(0))
    assert set(labels.tolist()) == {1, 2} and (labels == 1).sum() > (labels == 2).sum() and features.shape == (200, 5)
    assert "hidden.1.num_batches_tracked" not in generator_entries(generator)  # a 0-d count: not on the wire


def test_clip_groups_clip_each_models_gradient_on_its_own():
    """One SGD step of two linear heads, one pushed 100 times harder: clipped apart, each moves by
    at most the norm; clipped together (the total), the weak one would barely move."""
    first, second = (SplitModel(nn.Identity(), nn.Linear(2, 1, bias=False, dtype=torch.float64), 2) for _ in "ab")
    for model in (first, second):
        nn.init.zeros_(model.head.weight)
    x, y = torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.zeros(1, dtype=torch.long)

    def loss(inputs, features, logits, labels):
        return 100 * logits.sum() + second(inputs)[1].sum()

    train(MutualModels(first, second), x, y, epochs=1, batch_size=1, lr=1.0, seed=0, max_grad_norm=1.0,
          clip_groups=[[first.head.weight], [second.head.weight]], loss=loss)
    assert first.head.weight.detach().numpy() == pytest.approx(np.array([[-0.6, -0.8]]))  # 100 (3, 4) -> norm 1
    assert second.head.weight.detach().numpy() == pytest.approx(np.array([[-0.6, -0.8]]))  # (3, 4) -> norm 1


# --- with a model family ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def client_data(partition_id):
    return load_client_data("digits", "", ExperimentSettings().partition_spec(2), partition_id)


@pytest.mark.parametrize("method", [m if m == "lgfedavg" else pytest.param(m, marks=pytest.mark.slow)
                                    for m in SHARES_ACROSS])
def test_a_method_sharing_what_every_architecture_has_runs_a_model_family(method, digits):
    settings = ExperimentSettings(method=method, dataset="digits", model="htfe2")
    strategy_class, client_class = get_method(method)
    strategy = strategy_class(settings, build_method_model(settings, digits), 10)
    sent = strategy.shared_weights()
    assert sent and strategy.initialize_parameters(None).tensors  # no error: a family may run it
    for partition_id in (0, 1):  # the cnn, then the ResNet-18
        data = client_data(partition_id)
        client = client_class(settings, data, build_method_model(settings, data), 2, RecordDict())
        assert [a.shape for a in client.get_parameters({})] == [a.shape for a in sent]


def test_fml_and_fedkd_exchange_the_first_architecture_beside_the_clients_own(digits):
    settings = ExperimentSettings(method="fml", dataset="digits", model="htfe2")
    data = client_data(1)
    client = get_method("fml")[1](settings, data, build_method_model(settings, data), 2, RecordDict())
    assert client.model.state_dict().keys() != client.exchanged.state_dict().keys()  # the ResNet-18, the cnn
    assert client.exchanged.state_dict().keys() == build_method_model(settings, digits).state_dict().keys()


@pytest.mark.parametrize("method", ["fml", "fedkd"])
def test_the_second_model_is_the_threads_kept_one_set_back_as_built(method):
    """A thread's next message gets the second model the last one trained, every tensor as built,
    not one built anew; a client outside a message is not given one in use."""
    from protofl.client_app import release_worker_models
    from protofl.task.weights import all_tensors

    settings = ExperimentSettings(method=method, dataset="digits", model="htfe2")
    data = client_data(1)
    client_class = get_method(method)[1]

    def message(work):
        return release_worker_models(None, None, lambda _message, _context: work())

    def client():
        return client_class(settings, data, build_method_model(settings, data), 2, RecordDict())

    message(lambda: None)  # what earlier tests on this thread hold is free
    first = message(client).exchanged
    built = {k: v.clone() for k, v in all_tensors(first).items()}
    with torch.no_grad():
        for tensor in all_tensors(first).values():
            tensor.add_(1)
    second = message(client).exchanged
    assert second is first
    assert all(torch.equal(tensor, built[k]) for k, tensor in all_tensors(second).items())
    held = client().exchanged  # outside a message: in use until one ends
    assert held is first and client().exchanged is not held


def test_fedavg_still_refuses_a_model_family(digits):
    settings = ExperimentSettings(method="fedavg", dataset="digits", model="htfe2")
    strategy = get_method("fedavg")[0](settings, build_method_model(settings, digits), 10)
    with pytest.raises(ValueError, match="different architectures"):
        strategy.initialize_parameters(None)


def test_fedgen_drops_label_counts_that_are_not_the_clients(digits):
    """The sum against the size the client claims (the hostile suite covers the other fields)."""
    settings = ExperimentSettings(method="fedgen", dataset="digits")
    strategy = get_method("fedgen")[0](settings, build_method_model(settings, digits), 10)
    counts = np.array([3, 0, 2, 0, 0, 0, 0, 0, 0, 0], np.int64)

    def update(claimed):
        return ClientUpdate(partition_id=0, num_examples=claimed, parameters=[], statistics=None, metrics={},
                            uploads={LABEL_COUNTS: counts})

    strategy.check_update(update(5))
    with pytest.raises(PayloadError, match="sum to 5"):
        strategy.check_update(update(50))
    counts = np.array([2**62] * 3 + [2**62 + 5] + [0] * 6, np.int64)  # their int64 sum wraps round to 5
    with pytest.raises(PayloadError, match="label-counts"):
        strategy.check_update(update(5))


@pytest.mark.parametrize("method, option, value", [
    ("feddistill", "lambda", -1.0), ("fml", "alpha", 1.5), ("fml", "beta", -0.1), ("fedkd", "energy-start", 0.0),
    ("fedkd", "energy-end", 1.5), ("fedkd", "energy-rounds", 0), ("fedgen", "noise-dim", 0),
    ("fedgen", "generator-lr", 0.0), ("fedgen", "server-epochs", -1), ("fedtgp", "server-lr", 0.0),
    ("fedtgp", "margin-threshold", -1.0), ("fedtgp", "lambda", -1.0), ("fedgh", "server-epochs", -1),
    ("fedgh", "server-lr", float("nan")),
])
def test_a_bad_option_is_one_error_naming_it(method, option, value):
    options_class = get_method(method)[0].options_class
    with pytest.raises(ValueError, match=f"{method}.{option}"):
        options_class.from_settings(ExperimentSettings(method=method, options={option: value}))
