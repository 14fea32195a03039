"""The six baselines (FedProx, MOON, SCAFFOLD, FedOpt, FedNTD, FedRCL): their math on hand-checked
numbers, each strategy on hand-built fit results, each client for one fit on digits, and their
option checks (FedNH's table's baselines' too)."""

import json
import math

import numpy as np
import pytest
import torch
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from protofl.federation.wire import ArraySpec, decode_array, encode_array, indexed
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.fedavg import FedAvgClient
from protofl.strategies.fedntd import FedNTDClient, not_true_distillation, not_true_logits
from protofl.strategies.fedopt import FedOptOptions, FedOptStrategy, server_step
from protofl.strategies.fedprox import FedProxClient
from protofl.strategies.fedrcl import FedRCLClient, feature_levels, relaxed_contrastive_terms
from protofl.strategies.moon import MOONClient, model_contrastive_loss
from protofl.strategies.scaffold import SCAFFOLDClient, SCAFFOLDStrategy, client_control_update, step_multipliers
from protofl.task.data import load_client_data, load_dataset
from protofl.task.losses import proximal_term
from protofl.task.models import BasicBlock, build_model
from protofl.task.train import train
from protofl.task.weights import get_weights

BIG = 1 << 26  # a payload cap no test array comes near

# --- the math on hand-checked numbers -----------------------------------------------------


def test_proximal_term_is_half_the_squared_distance_and_its_gradient_the_difference():
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    anchors = [torch.tensor([0.0, 0.0]), torch.tensor([[1.0]])]
    term = proximal_term(w, anchors)
    assert term.item() == pytest.approx((1 + 4 + 4) / 2)  # (1^2 + 2^2 + (3 - 1)^2) / 2
    term.backward()
    assert w[0].grad.tolist() == [1.0, 2.0] and w[1].grad.tolist() == [[2.0]]  # w - w^t
    assert proximal_term([a.clone() for a in anchors], anchors).item() == 0.0


def test_model_contrastive_loss_per_sample():
    features = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    global_features = torch.tensor([[2.0, 0.0], [1.0, 0.0]])
    previous_features = torch.tensor([[0.0, 3.0], [-1.0, -1.0]])
    loss = model_contrastive_loss(features, global_features, previous_features, temperature=0.5)
    # sample 0: cos 1 with z_glob, 0 with z_prev: -log(e^(1/0.5) / (e^(1/0.5) + e^0)) = log(1 + e^-2)
    # sample 1: cos 1/sqrt 2 with z_glob, -1 with z_prev: logits (sqrt 2, -2): log(1 + e^(-2 - sqrt 2))
    expected = [math.log(1 + math.exp(-2)), math.log(1 + math.exp(-2 - math.sqrt(2)))]
    assert loss.shape == (2,)
    np.testing.assert_allclose(loss.numpy(), expected, rtol=1e-6)
    # the previous model's feature the same as the global's: log 2, whatever tau
    same = model_contrastive_loss(features, global_features, global_features, temperature=0.1)
    np.testing.assert_allclose(same.numpy(), [math.log(2)] * 2, rtol=1e-6)


def test_not_true_logits_drop_the_label_column_and_keep_the_order():
    logits = torch.tensor([[10.0, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    kept = not_true_logits(logits, torch.tensor([0, 2, 3]))
    assert kept.tolist() == [[11, 12, 13], [20, 21, 23], [30, 31, 32]]


def test_not_true_distillation_on_a_three_class_case():
    labels = torch.tensor([0, 1])
    # sample 0 (label 0): local not-true logits (0, ln 3) -> softmax (1/4, 3/4); global (1, 1) -> (1/2, 1/2):
    #   KL(global || local) = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3)
    # sample 1 (label 1): both (1, 2) without the true column: 0, however the true logits differ
    local = torch.tensor([[7.0, 0.0, math.log(3)], [1.0, 9.0, 2.0]])
    global_ = torch.tensor([[-5.0, 1.0, 1.0], [1.0, -3.0, 2.0]])
    loss = not_true_distillation(local, global_, labels, temperature=1.0)
    assert loss.item() == pytest.approx(math.log(4 / 3) / 4, rel=1e-6)  # the batch mean
    assert not_true_distillation(local[1:], global_[1:], labels[1:], 1.0).item() == pytest.approx(0.0, abs=1e-7)
    # tau = 2 on sample 0: local (0, ln 3 / 2) -> (1, sqrt 3) / (1 + sqrt 3); global (1/2, 1/2);
    #   KL = 1/2 ln((1 + sqrt 3) / 2) + 1/2 ln((1 + sqrt 3) / (2 sqrt 3)) = 1/2 ln((2 + sqrt 3) / (2 sqrt 3)),
    #   times tau^2 = 4
    r3 = math.sqrt(3)
    tau2 = not_true_distillation(local[:1], global_[:1], labels[:1], temperature=2.0)
    assert tau2.item() == pytest.approx(4 * 0.5 * math.log((2 + r3) / (2 * r3)), rel=1e-6)
    # logits scaled by tau at temperature tau: the same softmaxes, the loss tau^2 times as large
    scaled = not_true_distillation(2 * local, 2 * global_, labels, temperature=2.0)
    assert scaled.item() == pytest.approx(4 * loss.item(), rel=1e-6)


def test_not_true_distillation_of_bfloat16_logits_is_the_float32_divergence():
    """Under bf16 autocast (a BF16 CPU's amp=auto) the logits come in bfloat16, and a KL summed in
    bfloat16 of two near distributions is noise around 0: an honest client reported ntd-loss
    -8.7e-4 and was dropped. It is computed in float32: the float64 value of the same inputs, to
    float32's rounding of the 9 log-probabilities (~1e-7 each, relative to the logits' scale ~1)."""
    generator = torch.Generator().manual_seed(0)
    local = torch.randn(64, 10, generator=generator)
    global_ = local + 0.05 * torch.randn(64, 10, generator=generator)
    labels = torch.randint(0, 10, (64,), generator=generator)
    local, global_ = local.bfloat16(), global_.bfloat16()
    want = not_true_distillation(local.double(), global_.double(), labels, temperature=1.0).item()
    got = not_true_distillation(local, global_, labels, temperature=1.0)
    assert got.dtype == torch.float32
    assert 0 < want and got.item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_client_control_update_option_two():
    c_i = [np.array([0.0, 1.0], np.float32)]
    c = [np.array([0.25, -0.5], np.float32)]
    x, y = [np.array([1.0, 1.0], np.float32)], [np.array([0.6, 1.2], np.float32)]
    updated = client_control_update(c_i, c, x, y, steps=2, lr=0.5)
    # (x - y) / (K lr) = (0.4, -0.2) / 1; c_i - c + that = (0 - 0.25 + 0.4, 1 + 0.5 - 0.2)
    np.testing.assert_allclose(updated[0], [0.15, 1.3], rtol=1e-6)
    assert updated[0].dtype == np.float32


def adam(**kwargs):
    return FedOptOptions(optimizer="adam", **kwargs)


def test_step_multipliers_count_each_gradient_as_often_as_the_momentum_applies_it():
    assert step_multipliers(5, 0.0) == 5.0  # plain SGD: K
    # K = 3, beta = 0.5: the steps' gradients are applied (1 + .5 + .25) + (1 + .5) + 1 = 4.25 times
    assert step_multipliers(3, 0.5) == pytest.approx(4.25, rel=1e-15)


def test_a_server_optimiser_steps_the_parameters_and_averages_the_batchnorm_statistics(tmp_path):
    """FedOpt and SCAFFOLD (eta_g 2) on a BatchNorm ResNet: a running variance is averaged, never
    stepped (a step could drive it below zero), and so is the batch count."""
    adam, scaffold = {"optimizer": "adam", "eta": 1.0, "tau": 0.1}, {"server-lr": 2.0}
    for method, options in (("fedopt", adam), ("scaffold", scaffold)):
        # one step of lr 1: SCAFFOLD's Delta c = (x - y) / (K lr) - c = -by
        strategy = strategy_for(method, tmp_path / method, options, model="resnet10", local_epochs=1, lr=1.0)
        start_round(strategy, [0, 1])
        x0 = strategy.shared_weights()
        replies = [reply(p, shifted(x0, by), 10, **{k: encode_array(np.full_like(c, -by)) for k, c in
                                                    indexed("control-delta", getattr(strategy, "control", [])).items()})
                   for p, by in ((0, 1.0), (1, 3.0))]
        x1 = parameters_to_ndarrays(strategy.aggregate_fit(1, replies, [])[0])
        names = list(strategy.model.state_dict())
        for name, new, old in zip(names, x1, x0):
            if "running" in name or "num_batches" in name:
                np.testing.assert_allclose(new.astype(np.float64) - old, 2.0, err_msg=name)  # the mean
            elif method == "scaffold":
                np.testing.assert_allclose(new.astype(np.float64) - old, 4.0, rtol=1e-6, err_msg=name)  # 2 x 2
            else:
                assert not np.allclose(new.astype(np.float64) - old, 2.0), name  # Adam's step, not the mean


def test_fedopt_adam_two_rounds_on_one_entry():
    o = adam()  # eta 1, tau 0.1 ("auto"), beta1 0.9, beta2 0.99; v_(-1) = tau^2 = 0.01
    x1, m, v = server_step(np.float64(0.0), np.float64(1.0), 0.0, 0.01, o, 1)
    # m = 0.1; v = 0.99 * 0.01 + 0.01 * 1 = 0.0199; x = 0 + 0.1 / (sqrt(0.0199) + 0.1)
    assert (m, v) == pytest.approx((0.1, 0.0199))
    assert x1 == pytest.approx(0.1 / (math.sqrt(0.0199) + 0.1))
    x2, m, v = server_step(x1, np.float64(-0.5), m, v, o, 2)
    # m = 0.09 - 0.05 = 0.04; v = 0.99 * 0.0199 + 0.01 * 0.25 = 0.022201 = 0.149^2
    assert (m, v) == pytest.approx((0.04, 0.022201))
    assert x2 == pytest.approx(x1 + 0.04 / (0.149 + 0.1))


def test_fedopt_yogi_two_rounds_on_one_entry():
    o = FedOptOptions(optimizer="yogi")  # eta 1, tau 0.1
    x1, m, v = server_step(np.float64(0.0), np.float64(1.0), 0.0, 0.01, o, 1)
    # sign(0.01 - 1) = -1: v = 0.01 + 0.01 * 1 = 0.02; m = 0.1; x = 0.1 / (0.1 sqrt 2 + 0.1) = sqrt 2 - 1
    assert (m, v) == pytest.approx((0.1, 0.02))
    assert x1 == pytest.approx(math.sqrt(2) - 1)
    x2, m, v = server_step(x1, np.float64(0.1), m, v, o, 2)
    # sign(0.02 - 0.01) = +1: v = 0.02 - 0.01 * 0.01 = 0.0199; m = 0.09 + 0.01 = 0.1
    assert (m, v) == pytest.approx((0.1, 0.0199))
    assert x2 == pytest.approx(x1 + 0.1 / (math.sqrt(0.0199) + 0.1))
    # where they part: v = 1 >> delta^2 = 0.01: yogi 1 - 0.01 * 0.01, adam 0.99 * 1 + 0.01 * 0.01
    _, _, v = server_step(0.0, np.float64(0.1), 0.0, 1.0, o, 3)
    assert v == pytest.approx(1 - 0.01 * 0.01)
    assert server_step(0.0, np.float64(0.1), 0.0, 1.0, adam(), 3)[2] == pytest.approx(0.99 + 0.01 * 0.01)


def test_fedopt_adagrad_two_rounds_on_one_entry():
    o = FedOptOptions(optimizer="adagrad")  # eta 0.1, tau 0.01 ("auto"); v_(-1) = 1e-4
    x1, m, v = server_step(np.float64(0.0), np.float64(1.0), 0.0, 1e-4, o, 1)
    # m = 0.1; v = 1e-4 + 1 = 1.0001; x = 0.1 * 0.1 / (sqrt(1.0001) + 0.01)
    assert (m, v) == pytest.approx((0.1, 1.0001))
    assert x1 == pytest.approx(0.01 / (math.sqrt(1.0001) + 0.01))
    x2, m, v = server_step(x1, np.float64(-1.0), m, v, o, 2)
    # m = 0.09 - 0.1 = -0.01; v = 2.0001; x = x1 + 0.1 * -0.01 / (sqrt(2.0001) + 0.01)
    assert (m, v) == pytest.approx((-0.01, 2.0001))
    assert x2 == pytest.approx(x1 - 0.001 / (math.sqrt(2.0001) + 0.01))


def test_fedopt_flower_form_bias_corrects_adam_only():
    o = adam(form="flower")  # v from 0
    x1, m, v = server_step(np.float64(0.0), np.float64(1.0), 0.0, 0.0, o, 1)
    # m = 0.1, v = 0.01; eta_1 = sqrt(1 - 0.99^2) / (1 - 0.9^2) = sqrt(0.0199) / 0.19
    eta1 = math.sqrt(0.0199) / 0.19
    assert x1 == pytest.approx(eta1 * 0.1 / (0.1 + 0.1))
    x2, m, v = server_step(x1, np.float64(1.0), m, v, o, 2)
    # m = 0.09 + 0.1 = 0.19; v = 0.0099 + 0.01 = 0.0199; eta_2 = sqrt(1 - 0.99^3) / (1 - 0.9^3)
    eta2 = math.sqrt(1 - 0.99**3) / (1 - 0.9**3)
    assert x2 == pytest.approx(x1 + eta2 * 0.19 / (math.sqrt(0.0199) + 0.1))
    # yogi in Flower's form: no correction; v = 0 + 0.01 * 1 (sign(0 - 1) = -1), x = 0.1 / (0.1 + 0.1)
    assert server_step(np.float64(0.0), np.float64(1.0), 0.0, 0.0, FedOptOptions(optimizer="yogi", form="flower"),
                       1)[0] == pytest.approx(0.5)


def test_fedopt_flower_form_adagrad_is_flowers_fedadagrad():
    o = FedOptOptions(optimizer="adagrad", form="flower")  # eta 0.1, tau 0.01, beta1 0.9 (not used by Flower's)
    # Flower's FedAdagrad: m_t = delta_t (beta_1 = 0), v = 0 + 1: x = 0.1 * 1 / (1 + 0.01)
    x1, _, _ = server_step(np.float64(0.0), np.float64(1.0), 0.0, 0.0, o, 1)
    assert x1 == pytest.approx(0.1 / 1.01)


def test_fedopt_auto_eta_and_tau_resolve_per_optimizer():
    expected = {"adam": (1.0, 0.1), "yogi": (1.0, 0.1), "adagrad": (0.1, 0.01)}  # the paper's CIFAR-100 values
    for name, (eta, tau) in expected.items():
        settings = ExperimentSettings(method="fedopt", options={"optimizer": name})
        options = FedOptOptions.from_settings(settings)
        assert (options.server_lr, options.adaptivity) == (eta, tau)
        assert options.resolved(settings) == {"eta": eta, "tau": tau}
        assert settings.resolved(options, {})["fedopt.tau"] == tau
    given = ExperimentSettings(method="fedopt", options={"optimizer": "adagrad", "eta": 0.5})
    options = FedOptOptions.from_settings(given)
    assert options.server_lr == 0.5 and options.resolved(given) == {"tau": 0.01}  # only what was "auto"


# FedRCL: four unit vectors in the plane at 0, 60, 90 and 180 degrees, classes (0, 0, 1, 1). Similarities:
# s01 = cos 60 = 0.5, s02 = 0, s03 = -1, s12 = cos 30 = sqrt 3 / 2, s13 = cos 120 = -0.5, s23 = 0.
ANGLES = [0.0, 60.0, 90.0, 180.0]
R3 = math.sqrt(3)


def plane_batch(angles, scale=(1.0, 3.0)):
    """B x 2 x 1 x 2 activations whose spatial mean is 2 x the unit vector at each angle."""
    units = torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in angles])
    return torch.stack([units * s for s in scale], dim=2).unsqueeze(2)


def softplus(v):
    return math.log(1 + math.exp(v))


def test_relaxed_contrastive_terms_pick_the_hardest_pairs():
    labels = torch.tensor([0, 0, 1, 1])
    contrastive, penalty = relaxed_contrastive_terms(plane_batch(ANGLES), labels, 0.5, 0.7, 2)
    # loss_i = logsumexp([p_i, n1, n2] / 0.5) - p_i / 0.5, p_i the least similar of its class (itself included):
    # 0: p = s01 = 0.5, negatives (s02, s03) = (0, -1)        -> log(e^1 + e^0 + e^-2) - 1
    # 1: p = 0.5, negatives (s12, s13) = (sqrt 3 / 2, -0.5)   -> log(e^1 + e^sqrt 3 + e^-1) - 1
    # 2: p = s23 = 0, negatives (s21, s20) = (sqrt 3 / 2, 0)  -> log(1 + e^sqrt 3 + 1)
    # 3: p = 0, negatives (s31, s30) = (-0.5, -1)             -> log(1 + e^-1 + e^-2)
    expected = [math.log(math.e + 1 + math.exp(-2)) - 1, math.log(math.e + math.exp(R3) + math.exp(-1)) - 1,
                math.log(2 + math.exp(R3)), math.log(1 + math.exp(-1) + math.exp(-2))]
    np.testing.assert_allclose(contrastive.numpy(), expected, rtol=1e-5)
    # every same-class partner is below 0.7: n_i = -1, softplus((-1 - 1) / 0.5)
    np.testing.assert_allclose(penalty.numpy(), [softplus(-4)] * 4, rtol=1e-5)
    # one negative: the hardest only (samples 1 and 2 lose their second)
    one, _ = relaxed_contrastive_terms(plane_batch(ANGLES), labels, 0.5, 0.7, 1)
    np.testing.assert_allclose(one.numpy()[1:3], [math.log(math.e + math.exp(R3)) - 1, math.log(1 + math.exp(R3))],
                               rtol=1e-5)


def test_relaxed_penalty_fires_only_above_the_threshold():
    labels = torch.tensor([0, 0, 1, 1])
    _, penalty = relaxed_contrastive_terms(plane_batch(ANGLES), labels, 0.5, 0.4, 2)
    # class 0's pair (0.5) is above 0.4: n = 0.5, softplus((0.5 - 1) / 0.5); class 1's (0) still is not
    np.testing.assert_allclose(penalty.numpy(), [softplus(-1)] * 2 + [softplus(-4)] * 2, rtol=1e-5)
    # a sample alone in its class has no partner: n = -1 whatever the threshold
    lone = torch.tensor([0, 0, 1, 2])
    contrastive, penalty = relaxed_contrastive_terms(plane_batch(ANGLES), lone, 0.5, -2.0, 2)
    np.testing.assert_allclose(penalty.numpy(), [softplus(-1), softplus(-1), softplus(-4), softplus(-4)], rtol=1e-5)
    # sample 2 alone: p = s22 = 1, negatives (s21, s20 or s23) = (sqrt 3 / 2, 0): log(e^2 + e^sqrt 3 + 1) - 2
    assert contrastive[2].item() == pytest.approx(math.log(math.exp(2) + math.exp(R3) + 1) - 2, rel=1e-5)


def test_relaxed_terms_of_a_one_class_batch_have_no_negatives_and_finite_gradients():
    activations = plane_batch([0.0, 30.0, 45.0]).requires_grad_(True)
    contrastive, penalty = relaxed_contrastive_terms(activations, torch.tensor([1, 1, 1]), 0.05, 0.7, 2)
    np.testing.assert_allclose(contrastive.detach().numpy(), [0.0] * 3, atol=1e-6)  # only the positive
    (contrastive.sum() + penalty.sum()).backward()
    assert torch.isfinite(activations.grad).all()


def meta_model(name):
    with torch.device("meta"):
        return build_model(name, 1, 10, 16, seed=0)


def level_channels(model, levels):
    """The channels of each level's output on a meta batch."""
    shapes = []
    hooks = [m.register_forward_hook(lambda _m, _in, out: shapes.append(out.shape[1])) for m in levels]
    with torch.device("meta"):
        model(torch.zeros(2, 1, 16, 16))
    for hook in hooks:
        hook.remove()
    return shapes


@pytest.mark.slow  # every backbone built and run: about 3 s
def test_feature_levels_of_each_backbone():
    cnn = meta_model("cnn")
    levels = feature_levels(cnn)
    assert [type(m) for m in levels[:2]] == [torch.nn.MaxPool2d] * 2 and levels[2] is cnn.body
    assert level_channels(cnn, levels) == [32, 64, 512]

    for name, stage_ends in (("resnet10", [3, 4, 5, 6]), ("resnet18", [4, 6, 8, 10]), ("resnet8-x4", [3, 4, 5])):
        model = meta_model(name)
        levels = feature_levels(model)
        # the stem's norm, then the last BasicBlock of each stage (body: conv, norm, relu, blocks..., pool)
        assert levels[0] is model.body[1] and isinstance(levels[0], torch.nn.BatchNorm2d), name
        assert levels[1:] == [model.body[i] for i in stage_ends], name
        assert all(isinstance(m, BasicBlock) for m in levels[1:])
        assert level_channels(model, levels) == [64, 64, 128, 256, 512][: len(stage_ends) + 1], name

    vision = meta_model("tv-resnet18")
    net = next(m for m in vision.body.modules() if hasattr(m, "layer4"))
    levels = feature_levels(vision)
    assert levels == [net.bn1, net.layer1, net.layer2, net.layer3, net.layer4]
    assert level_channels(vision, levels) == [64, 64, 128, 256, 512]

    googlenet = meta_model("tv-googlenet")
    net = next(m for m in googlenet.body.modules() if hasattr(m, "inception5b"))
    assert feature_levels(googlenet) == [net.maxpool1, net.maxpool2, net.maxpool3, net.maxpool4, googlenet.body]

    mobilenet = meta_model("tv-mobilenetv2")
    with pytest.raises(ValueError, match="fedrcl.levels='feature'"):
        feature_levels(mobilenet)
    for model in (cnn, vision, mobilenet):
        assert feature_levels(model, "feature") == [model.body]


# --- the strategies on hand-built fit results ----------------------------------------------


def strategy_for(method, tmp_path, options=None, **settings):
    config = ExperimentSettings(method=method, output_dir=str(tmp_path), run_name="run", options=options or {},
                                **settings)
    return get_method(method)[0](config, build_method_model(config, load_dataset("digits")), 10)


def reply(pid, parameters, num_examples, **metrics):
    metrics = {"partition-id": pid, "train-loss": 1.0, **metrics}
    return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(parameters), num_examples, metrics)


def shifted(arrays, by):
    return [(a + by).astype(a.dtype) for a in arrays]


def assert_moved(new, old, by, atol=1e-5):
    for n, o in zip(new, old):
        np.testing.assert_allclose(n.astype(np.float64) - o, by, atol=atol)


@pytest.mark.parametrize("method,losses", [
    ("fedprox", ("proximal-loss",)), ("moon", ("contrastive-loss",)), ("fedntd", ("ntd-loss",)),
    ("fedrcl", ("contrastive-loss", "penalty-loss")),
])
@pytest.mark.parametrize("weighted", [True, False])
def test_fedavg_like_strategies_average_as_fedavg(tmp_path, method, losses, weighted):
    strategy = strategy_for(method, tmp_path, {"weighted": weighted})
    start_round(strategy, [0, 1])
    x = strategy.shared_weights()
    a = reply(0, shifted(x, 1.0), 10, **{k: 0.2 for k in losses})
    b = reply(1, shifted(x, 5.0), 30, **{k: 0.6 for k in losses})
    parameters, metrics = strategy.aggregate_fit(1, [a, b], [])
    assert metrics["accepted"] == 2
    # by training size: (10 * 1 + 30 * 5) / 40 = 4; unweighted: (1 + 5) / 2 = 3
    assert_moved(parameters_to_ndarrays(parameters), x, 4.0 if weighted else 3.0)
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    for key in losses:  # by training size, whatever the parameters' weighting: (10 * 0.2 + 30 * 0.6) / 40
        assert record[key.replace("-", "_")] == pytest.approx(0.5)


def control_delta(value, shapes):
    return {name: encode_array(np.full(shape, value, np.float32)) for name, shape in
            zip((f"control-delta/{i}" for i in range(len(shapes))), shapes)}


def test_scaffold_strategy_steps_uniformly_and_averages_the_controls_over_every_partition(tmp_path):
    # one step of lr 1 (batch 30): Delta c = (x - y) / (K lr) - c = 1 and 3 for a move of -1 and -3
    strategy = strategy_for("scaffold", tmp_path, {"server-lr": 0.5}, num_partitions=5, local_epochs=1, lr=1.0,
                            batch_size=30)
    start_round(strategy, [0, 1, 2])
    assert isinstance(strategy, SCAFFOLDStrategy)
    x = strategy.shared_weights()
    parameters = [p for p in strategy.model.parameters() if p.requires_grad]
    shapes = [tuple(p.shape) for p in parameters]
    specs = strategy.upload_specs()
    assert list(specs) == [f"control-delta/{i}" for i in range(len(parameters))]
    assert [s.shape for s in specs.values()] == shapes and {s.dtypes for s in specs.values()} == {("float32",)}

    def broadcast_control():
        config = strategy.round_configs(1, [0])[0]
        return [decode_array(config[f"control/{i}"], ArraySpec(s), BIG) for i, s in enumerate(shapes)]

    assert all((c == 0).all() for c in broadcast_control())
    a = reply(0, shifted(x, -1.0), 10, **control_delta(1.0, shapes))
    b = reply(1, shifted(x, -3.0), 30, **control_delta(3.0, shapes))
    no_delta = reply(2, shifted(x, -2.0), 20)  # an honest-looking update without its control-delta upload
    new, metrics = strategy.aggregate_fit(1, [a, b, no_delta], [])
    assert metrics["accepted"] == 2
    dropped = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]["dropped"]
    assert [d["partition"] for d in dropped] == [2] and "missing 'control-delta/0'" in dropped[0]["reason"]
    # x + 0.5 * mean(-1, -3) uniform = x - 1 (by training size it would be x - 1.25)
    assert_moved(parameters_to_ndarrays(new), x, -1.0)
    # c = 0 + (1 + 3) / N, N = 5 partitions (not the 2 that replied, nor the 3 asked)
    for c in broadcast_control():
        np.testing.assert_allclose(c, 0.8, rtol=1e-6)
    assert all(c.dtype == np.float32 for c in strategy.control)


def test_fedopt_strategy_keeps_its_moments_across_rounds(tmp_path):
    strategy = strategy_for("fedopt", tmp_path, {"optimizer": "adam", "eta": 1.0, "tau": 0.1})
    assert isinstance(strategy, FedOptStrategy)
    assert all(np.allclose(v, 0.01, rtol=1e-12) for v in strategy.second_moment)  # v_(-1) = tau^2
    start_round(strategy, [0, 1])
    x0 = strategy.shared_weights()
    a, b = reply(0, shifted(x0, 1.0), 10), reply(1, shifted(x0, 3.0), 30)
    x1 = parameters_to_ndarrays(strategy.aggregate_fit(1, [a, b], [])[0])
    # Delta = mean(1, 3) = 2, uniform (Algorithm 2); m = 0.2, v = 0.99 * 0.01 + 0.01 * 4 = 0.0499
    assert_moved(x1, x0, 0.2 / (math.sqrt(0.0499) + 0.1))
    strategy.admission.sent_parameters = x1  # as configure_fit leaves it for round 2
    a, b = reply(0, shifted(x1, -1.0), 10), reply(1, shifted(x1, -1.0), 30)
    x2 = parameters_to_ndarrays(strategy.aggregate_fit(2, [a, b], [])[0])
    # Delta = -1: m = 0.9 * 0.2 - 0.1 = 0.08; v = 0.99 * 0.0499 + 0.01 = 0.059401
    assert_moved(x2, x1, 0.08 / (math.sqrt(0.059401) + 0.1))
    assert all(np.allclose(m, 0.08) for m in strategy.first_moment)
    assert all(np.allclose(v, 0.059401) for v in strategy.second_moment)


def test_fedopt_flower_form_averages_by_training_size_from_a_zero_second_moment(tmp_path):
    strategy = strategy_for("fedopt", tmp_path, {"optimizer": "adam", "eta": 1.0, "tau": 0.1, "form": "flower"})
    assert all((v == 0).all() for v in strategy.second_moment)
    start_round(strategy, [0, 1])
    x0 = strategy.shared_weights()
    a, b = reply(0, shifted(x0, 1.0), 10), reply(1, shifted(x0, 3.0), 30)
    x1 = parameters_to_ndarrays(strategy.aggregate_fit(1, [a, b], [])[0])
    # Delta = (10 * 1 + 30 * 3) / 40 = 2.5: m = 0.25, v = 0.01 * 6.25 = 0.0625 (sqrt 0.25);
    # eta_1 = sqrt(1 - 0.99^2) / (1 - 0.9^2)
    assert_moved(x1, x0, math.sqrt(0.0199) / 0.19 * 0.25 / (0.25 + 0.1))


# --- the clients, one fit on digits ----------------------------------------------------------

BATCH = 32
FIT = {"server-round": 1, "seed": 7}


@pytest.fixture(scope="module")
def data():
    spec = ExperimentSettings(batch_size=BATCH).partition_spec(2)
    return load_client_data("digits", "", spec, 0)


def settings_of(method, **options):
    return ExperimentSettings(method=method, local_epochs=1, batch_size=BATCH, options=options)


def make_client(cls, method, data, state=None, **options):
    settings = settings_of(method, **options)
    return cls(settings, data, build_method_model(settings, data), 2, RecordDict() if state is None else state)


@pytest.fixture(scope="module")
def received(data):
    """The weights the server sends: another seed's model than the clients build (seed 0)."""
    return get_weights(build_model("cnn", data.in_channels, data.num_classes, data.image_size, seed=1))


@pytest.fixture(scope="module")
def fedavg_trained(data, received):
    """FedAvg's fit from ``received``: the parameters it returns."""
    return copied(make_client(FedAvgClient, "fedavg", data).fit(received, dict(FIT))[0])


def copied(arrays):
    """A model's arrays as they are now (get_weights and fit return views of its tensors)."""
    return [a.copy() for a in arrays]


def distance(a, b):
    return math.sqrt(sum(float(np.sum((x.astype(np.float64) - y) ** 2)) for x, y in zip(a, b)))


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_fedprox_with_mu_zero_is_fedavg_and_mu_keeps_it_near_the_received_model(data, received, fedavg_trained):
    plain, _, metrics = make_client(FedProxClient, "fedprox", data, mu=0.0).fit(received, dict(FIT))
    assert_same(plain, fedavg_trained)
    assert metrics["proximal-loss"] > 0  # measured, even when not weighed in
    held, _, _ = make_client(FedProxClient, "fedprox", data, mu=10.0).fit(received, dict(FIT))
    assert 0 < distance(held, received) < 0.5 * distance(fedavg_trained, received)


def test_fedntd_with_beta_zero_is_fedavg(data, received, fedavg_trained):
    client = make_client(FedNTDClient, "fedntd", data, beta=0.0)
    trained, _, metrics = client.fit(received, dict(FIT))
    assert_same(trained, fedavg_trained)
    assert metrics["ntd-loss"] > 0
    assert not client.global_model.training and all(not p.requires_grad for p in client.global_model.parameters())
    assert_same(get_weights(client.global_model), received)  # distilled from the model received this round


def test_moon_keeps_its_model_for_the_next_round_and_scores_the_global_one(data, received):
    state = RecordDict()
    client = make_client(MOONClient, "moon", data, state)
    initial = copied(get_weights(client.model))
    trained, _, metrics = client.fit(received, dict(FIT))
    trained = copied(trained)
    assert metrics["contrastive-loss"] > 0
    assert_same(get_weights(client.previous_model), initial)  # before any training: the initial model
    assert_same(get_weights(client.global_model), received)
    names = list(client.model.state_dict())
    assert {f"model/{n}" for n in names} <= set(client.local_state)
    assert_same([client.local_state[f"model/{n}"] for n in names], trained)

    # evaluation scores the global model it is sent, not the kept one
    evaluated = client.evaluate(received, dict(FIT))
    assert evaluated == make_client(FedAvgClient, "fedavg", data).evaluate(received, dict(FIT))

    # the next round's client object on the node: its previous model is the one the last fit kept
    again = make_client(MOONClient, "moon", data, state)
    again.fit(received, {"server-round": 2, "seed": 8})
    assert_same(get_weights(again.previous_model), trained)
    assert_same(get_weights(again.global_model), received)


def scaffold_config(control, server_round=1, seed=7, applied=0):
    arrays = {k: encode_array(v) for k, v in indexed("control", control).items()}
    return {"server-round": server_round, "seed": seed, "control-applied": encode_array(np.array([applied]))} | arrays


def test_scaffold_client_first_and_second_fit(data, received, fedavg_trained):
    state = RecordDict()
    client = make_client(SCAFFOLDClient, "scaffold", data, state)
    names = [n for n, p in client.model.named_parameters() if p.requires_grad]
    steps = []
    counting = client.model.register_forward_pre_hook(lambda *_: steps.append(1))
    zeros = [np.zeros_like(w) for w in received]  # the cnn: every entry a parameter
    trained, _, metrics = client.fit(received, scaffold_config(zeros))
    trained = copied(trained)
    counting.remove()
    assert_same(trained, fedavg_trained)  # c = c_i = 0: plain SGD, FedAvg's step for step
    k, lr = len(steps), 0.05
    assert k == data.num_train // BATCH  # one epoch, the partial batch dropped
    for i, (name, x, y) in enumerate(zip(names, received, trained)):
        expected = (x.astype(np.float64) - y) / (k * lr)  # c_i+ = 0 - 0 + (x - y) / (K lr); Delta c = c_i+ - 0
        delta = decode_array(metrics[f"control-delta/{i}"], ArraySpec(x.shape), BIG)
        np.testing.assert_allclose(delta, expected, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(client.local_state[f"control-pending/{name}"], expected, rtol=1e-5, atol=1e-7)
    c_i = [client.local_state[f"control-pending/{n}"].copy() for n in names]

    # round 2, a new client object on the node: its steps add c - c_i to every gradient
    rng = np.random.default_rng(0)
    control = [rng.normal(0, 0.05, w.shape).astype(np.float32) for w in received]
    again = make_client(SCAFFOLDClient, "scaffold", data, state)
    moved, _, metrics = again.fit(received, scaffold_config(control, 2, 8, applied=1))  # round 1's c_i+ applied
    reference = build_model("cnn", data.in_channels, data.num_classes, data.image_size, seed=1)
    offsets = [torch.from_numpy(c - ci) for c, ci in zip(control, c_i)]
    train(reference, data.train_x, data.train_y, epochs=1, batch_size=BATCH, lr=lr, seed=8,
          gradient_offsets=offsets, **again.settings.precision)
    for a, b in zip(moved, get_weights(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    plain = build_model("cnn", data.in_channels, data.num_classes, data.image_size, seed=1)
    train(plain, data.train_x, data.train_y, epochs=1, batch_size=BATCH, lr=lr, seed=8, **again.settings.precision)
    assert distance(moved, get_weights(plain)) > 1e-3  # the offsets moved it
    for i, (x, y, c, ci) in enumerate(zip(received, moved, control, c_i)):
        expected = (ci.astype(np.float64) - c + (x - y.astype(np.float64)) / (k * lr)) - ci  # c_i+ - c_i
        delta = decode_array(metrics[f"control-delta/{i}"], ArraySpec(x.shape), BIG)
        np.testing.assert_allclose(delta, expected, rtol=1e-4, atol=1e-6)


def test_scaffold_client_with_momentum_counts_each_gradient_as_often_as_it_was_applied(data, received):
    """With momentum beta the K steps apply each corrected gradient sum_k (1 - beta^k) / (1 - beta)
    times in all: c_i+ = (x - y) / (that sum x lr), so that c_i estimates the mean gradient."""
    settings = ExperimentSettings(method="scaffold", local_epochs=1, batch_size=BATCH, momentum=0.5)
    client = SCAFFOLDClient(settings, data, build_method_model(settings, data), 2, RecordDict())
    zeros = [np.zeros_like(w) for w in received]
    trained, _, metrics = client.fit(received, scaffold_config(zeros))
    applied = step_multipliers(data.num_train // BATCH, 0.5)
    assert data.num_train // BATCH < applied < 2 * (data.num_train // BATCH)
    for i, (x, y) in enumerate(zip(received, trained)):
        delta = decode_array(metrics[f"control-delta/{i}"], ArraySpec(x.shape), BIG)
        np.testing.assert_allclose(delta, (x.astype(np.float64) - y) / (applied * 0.05), rtol=1e-5, atol=1e-7)


def test_scaffold_keeps_c_the_mean_of_the_clients_c_i_when_an_update_is_lost(tmp_path):
    """Line 17 keeps c = (1 / N) sum_i c_i only if a client's c_i+ replaces its c_i exactly when the
    server applies its Delta c: a client whose reply was lost (a timeout, admission, a rejected
    round) keeps its c_i, and its next Delta c is from that."""
    settings = ExperimentSettings(method="scaffold", local_epochs=1, batch_size=BATCH, momentum=0.5,
                                  output_dir=str(tmp_path), run_name="run", num_partitions=3)
    datas = [load_client_data("digits", "", settings.partition_spec(3), p) for p in range(3)]
    strategy = get_method("scaffold")[0](settings, build_method_model(settings, datas[0]), 10)
    states = [RecordDict() for _ in datas]

    def clients():
        return [SCAFFOLDClient(settings, d, build_method_model(settings, d), 3, s) for d, s in zip(datas, states)]

    def fit_all(server_round, parameters):
        start_round(strategy, [0, 1, 2])
        strategy.admission.sent_parameters = list(parameters)  # as configure_fit sets it
        replies = []
        for client, config in zip(clients(), strategy.round_configs(server_round, [0, 1, 2])):
            arrays, n, metrics = client.fit(parameters, config)
            replies.append((FakeProxy(str(100 + client.data.partition_id)),
                            FitRes(OK, ndarrays_to_parameters(arrays), n, metrics)))
        return replies

    x = strategy.shared_weights()
    new, metrics = strategy.aggregate_fit(1, fit_all(1, x)[:2], [])  # partition 2's reply lost
    assert metrics["accepted"] == 2
    new, metrics = strategy.aggregate_fit(2, fit_all(2, parameters_to_ndarrays(new)), [])
    assert metrics["accepted"] == 3
    counted = []  # each client's c_i as its next fit counts it
    for client, config in zip(clients(), strategy.round_configs(3, [0, 1, 2])):
        client.receive(parameters_to_ndarrays(new), client.round_of(config))
        counted.append(client.client_control)
    for i, c in enumerate(strategy.control):  # float32 sums of 3 terms: a few ulps of the largest
        mean = np.mean([ci[i].astype(np.float64) for ci in counted], axis=0)
        np.testing.assert_allclose(c, mean, rtol=0, atol=1e-6 * max(np.abs(mean).max(), 1.0))


def test_scaffold_client_without_the_server_control_is_a_clear_error(data, received):
    with pytest.raises(ValueError, match="control variate"):
        make_client(SCAFFOLDClient, "scaffold", data).fit(received, dict(FIT))


def no_forward_hooks(model):
    return all(not m._forward_hooks for m in model.modules())


def test_fedrcl_uploads_its_losses_and_leaves_no_hooks(data, received):
    client = make_client(FedRCLClient, "fedrcl", data)
    _, _, metrics = client.fit(received, dict(FIT))
    assert metrics["contrastive-loss"] > 0 and metrics["penalty-loss"] >= 0
    assert no_forward_hooks(client.model)
    assert client.activations == []  # every batch's levels taken


def test_fedrcl_hooks_go_even_when_training_fails(data, received, monkeypatch):
    client = make_client(FedRCLClient, "fedrcl", data)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("protofl.strategies.fedrcl.relaxed_contrastive_terms", broken)
    with pytest.raises(RuntimeError, match="boom"):
        client.fit(received, dict(FIT))
    assert no_forward_hooks(client.model)


# --- options out of range ----------------------------------------------------------------------


@pytest.mark.parametrize("method,key,value", [
    ("fedprox", "mu", -1.0),
    ("moon", "mu", -1.0),
    ("moon", "temperature", 0.0),
    ("scaffold", "server-lr", 0.0),
    ("fedopt", "beta1", 1.0),
    ("fedopt", "beta2", -0.1),
    ("fedopt", "eta", 0.0),
    ("fedopt", "tau", -1.0),
    ("fedntd", "beta", -1.0),
    ("fedntd", "temperature", 0.0),
    ("fedrcl", "temperature", 0.0),
    ("fedrcl", "negatives", 0),
    ("fedrcl", "lambda-scl", -1.0),
    ("fedrep", "head-epochs", -1),
    ("fedbabu", "finetune-epochs", -1),
    ("ditto", "lambda", -0.5),
    ("creff", "match-epochs", -1),
    ("creff", "features-per-class", 0),
    ("creff", "feature-lr", 0.0),
    ("creff", "classifier-lr", float("nan")),
])
def test_an_option_out_of_range_is_one_error_naming_it(method, key, value):
    settings = ExperimentSettings.from_run_config({"method": method, f"{method}.{key}": value})
    options_class = get_method(method)[0].options_class
    with pytest.raises(ValueError, match=rf"{method}\b.*\b{key}\b"):
        options_class.from_settings(settings)
    options_class.from_settings(ExperimentSettings.from_run_config({"method": method}))  # the defaults are fine
