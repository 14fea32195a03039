"""The training step captured as a CUDA graph (``cuda-graphs``): the captured step's code, with its
static buffers and without a graph (``"static"``), trains exactly as the plain loop on any device;
on CUDA (``pytest -m gpu``, skipped elsewhere) the captured step gives the eager step's numbers."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from inprocess import run_in_process
from test_resume import assert_same_rounds

import protofl.task.capture as capture_module
from protofl.settings import ExperimentSettings
from protofl.strategies import METHODS, get_method
from protofl.task.augment import make_augment
from protofl.task.models import MODELS, SeededDropout, build_model
from protofl.task.capture import DeviceMeans, StepState, release_kept_steps, resolve_cuda_graphs
from protofl.task.statistics import FeatureSums
from protofl.task.train import train

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="no CUDA device")


@pytest.fixture(autouse=True)
def no_kept_steps():
    """Each test starts without the steps an earlier one kept on this thread."""
    release_kept_steps()
    yield
    release_kept_steps()


def data(n=70, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 16, 16, generator=generator)
    return x.to(device), (torch.arange(n) % 10).to(device)


def plus_cross_entropy(extra_loss):
    """A training loop's loss: the cross-entropy plus ``extra_loss(features, logits, labels)``."""
    return lambda inputs, features, logits, labels: (F.cross_entropy(logits, labels)
                                                     + extra_loss(features, logits, labels))


def trained(cuda_graphs, model="cnn", device="cpu", extra_loss=None, **kwargs):
    """(weights, mean loss) of the CNN trained from its seeded init."""
    net = build_model(model, 1, 10, 16, seed=0).to(device)
    x, y = data(device=device)
    arguments = {"epochs": 2, "batch_size": 16, "lr": 0.05, "seed": 1} | kwargs
    loss = train(net, x, y, loss=extra_loss and plus_cross_entropy(extra_loss), cuda_graphs=cuda_graphs, **arguments)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, loss


def counted_calls(monkeypatch, cls, name, record):
    """A list that grows by ``record(*arguments)`` each time method ``name`` of ``cls`` runs."""
    calls = []
    original = getattr(cls, name)

    def counting(self, *arguments):
        calls.append(record(*arguments))
        return original(self, *arguments)

    monkeypatch.setattr(cls, name, counting)
    return calls


def counted_steps(monkeypatch):
    """A list that grows by the batch size per step the captured step's object runs."""
    return counted_calls(monkeypatch, capture_module.CapturedStep, "__call__", lambda inputs, labels, *masks: len(labels))


@pytest.mark.parametrize("options", [
    {},
    {"momentum": 0.9, "weight_decay": 5e-4, "max_grad_norm": 1.0},
    {"partial_batch": "keep", "momentum": 0.5},
    {"augment": make_augment("crop-flip", torch.zeros(1))},
], ids=["plain", "momentum-decay-clip", "partial-batch", "augment"])
def test_the_captured_steps_code_without_a_graph_trains_as_the_plain_loop(monkeypatch, options):
    steps = counted_steps(monkeypatch)
    want_weights, want_loss = trained("off", **options)
    assert steps == []
    got_weights, got_loss = trained("static", **options)
    # 70 samples in batches of 16: 4 full batches an epoch through the static step; the partial
    # batch of 6 ("keep") runs the plain step
    assert steps == [16] * 8
    assert got_loss == want_loss
    for name, tensor in want_weights.items():
        assert torch.equal(got_weights[name], tensor), name


def test_an_extra_loss_and_its_sums_on_the_device_train_as_in_the_plain_loop(monkeypatch):
    def with_extra(cuda_graphs):
        seen = FeatureSums(10, 512, torch.device("cpu"), skip=4)  # the last epoch's 4 batches only

        def extra_loss(features, logits, labels):
            seen.add(features, labels)
            return 0.1 * features.pow(2).mean()

        weights, loss = trained(cuda_graphs, extra_loss=extra_loss)
        return weights, loss, seen

    steps = counted_steps(monkeypatch)
    want = with_extra("off")
    got = with_extra("static")
    assert len(steps) == 8 and got[1] == want[1]
    assert all(torch.equal(got[0][k], v) for k, v in want[0].items())
    assert torch.equal(got[2].sums, want[2].sums) and torch.equal(got[2].counts, want[2].counts)
    assert int(got[2].counts.sum()) == 4 * 16


def test_device_means_of_bfloat16_values_sum_in_float32():
    """A loss part computed under bf16 autocast is a bfloat16 scalar; summed in bfloat16 its sum
    stalls (at 4 the spacing is 1/32, more than the 0.01 added): 1000 batches of 0.01 mean 0.01."""
    parts = DeviceMeans()
    for _ in range(1000):
        parts.add(loss=torch.tensor(0.01, dtype=torch.bfloat16))
    assert parts.means()["loss"] == pytest.approx(float(torch.tensor(0.01, dtype=torch.bfloat16)), rel=1e-5)


def kept_step_loads(monkeypatch):
    """A list that grows by one each time a kept step takes a client's tensors."""
    return counted_calls(monkeypatch, capture_module.KeptStep, "load", lambda tensors, state: len(tensors))


def client_training(cuda_graphs, seed, n=70, lr=0.05, device="cpu", model="cnn"):
    """(weights, mean loss, training-mode feature sums, loss-part means) of one client: its own
    init and data, a loss that reads a tensor of its own, sums of the last epoch's features."""
    net = build_model(model, 1, 10, 16, seed=seed).to(device)
    x, y = data(n, device, seed)
    target = torch.randn(10, 512, generator=torch.Generator().manual_seed(seed)).to(device)
    seen, parts = FeatureSums(10, 512, torch.device(device), skip=2), DeviceMeans()

    def extra_loss(features, logits, labels):
        seen.add(features, labels)
        pull = (features - target[labels]).pow(2).mean()
        parts.add(pull=pull)
        return 0.01 * pull

    loss = train(net, x, y, loss=plus_cross_entropy(extra_loss),
                 step_state=StepState((), {"target": target}, [seen, parts]),
                 cuda_graphs=cuda_graphs, epochs=2, batch_size=16, lr=lr, seed=seed, momentum=0.9,
                 partial_batch="keep")
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, loss, seen, parts.means()


def assert_same_training(got, want, exact=True):
    close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-3, atol=1e-4))
    assert got[1] == (want[1] if exact else pytest.approx(want[1], rel=1e-4))
    for name, tensor in want[0].items():
        assert close(got[0][name], tensor), name
    assert torch.equal(got[2].counts, want[2].counts) and close(got[2].sums, want[2].sums)
    assert got[3].keys() == want[3].keys() == {"pull"}
    assert got[3]["pull"] == (want[3]["pull"] if exact else pytest.approx(want[3]["pull"], rel=1e-4))


@pytest.mark.parametrize("n", [70, 40, 12], ids=["as-many", "fewer", "one-partial-batch"])
def test_a_step_kept_from_one_client_trains_the_next_as_the_plain_loop(monkeypatch, n):
    """The next client's weights, loss input, momentum (zeroed: its first step's is its gradient)
    and sums go through the step kept from the first: full and partial batches alike."""
    loads = kept_step_loads(monkeypatch)
    want = client_training("off", seed=2, n=n)
    client_training("static", seed=1)
    assert loads == []
    got = client_training("static", seed=2, n=n)
    assert len(loads) == 1
    assert_same_training(got, want)


@pytest.mark.slow  # two dropout backbones trained both ways: about 4 s
def test_dropout_masks_are_drawn_before_the_step_and_fed_to_it_as_in_the_plain_loop(monkeypatch):
    """tv-mobilenetv2's dropout: after a first step that draws for itself (and shows the mask's
    shape), each step's mask is drawn from the client's dropout generator before the step and goes
    in through the step's static buffers (a captured step cannot draw), for the first client and
    for the next one, whose kept step belongs to the first client's model."""
    fed = counted_calls(monkeypatch, capture_module.CapturedStep, "__call__", lambda inputs, labels, *masks: len(masks))
    loads = kept_step_loads(monkeypatch)
    want = {seed: client_training("off", seed=seed, model="tv-mobilenetv2") for seed in (1, 2)}
    for seed in (1, 2):  # each checked before the next: the kept step adds to the first client's sums
        assert_same_training(client_training("static", seed=seed, model="tv-mobilenetv2"), want[seed])
    assert fed == [0] + [1] * 7 + [1] * 8 and len(loads) == 1


def test_a_dropout_layer_never_draws_inside_a_capture(monkeypatch):
    layer = SeededDropout(0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="feed a captured step its masks"):
        layer(torch.ones(2, 3))


def test_a_step_is_kept_only_for_the_same_arguments(monkeypatch):
    loads = kept_step_loads(monkeypatch)
    client_training("static", seed=1)
    client_training("static", seed=2, lr=0.1)  # another learning rate: a step of its own
    trained("static")  # another loss: a step of its own
    assert loads == []
    client_training("static", seed=3)
    client_training("static", seed=4, lr=0.1)
    trained("static", model="cnn")
    assert len(loads) == 3


def test_feature_sums_skip_their_first_batches_counting_on_the_device():
    seen = FeatureSums(3, 2, torch.device("cpu"), skip=1)
    seen.add(torch.tensor([[float("nan"), 1.0]]), torch.tensor([1]))  # skipped, even a NaN
    seen.add(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 0]))
    assert seen.counts.tolist() == [2, 0, 0] and int(seen.batches) == 2
    assert seen.means().tolist() == [[2.0, 3.0], [0.0, 0.0], [0.0, 0.0]]


def test_cuda_graphs_auto_captures_on_cuda_only():
    assert resolve_cuda_graphs("auto", torch.device("cpu")) == "off"
    assert resolve_cuda_graphs("auto", torch.device("cuda")) == "captured"
    assert resolve_cuda_graphs("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="cuda-graphs must be one of"):
        resolve_cuda_graphs("on", torch.device("cpu"))


CAPTURABLE = {  # (method, its options) -> whether its training step may be captured
    ("fedavg", ()): True,
    ("fednh", ()): True,
    ("fedproto", ()): True,
    ("fedsa", ()): True,  # loss-form "sample"
    ("fedsa", (("loss-form", "prototype"),)): False,  # the batch's classes: unique() waits for the host
    ("fedskc", ()): False,  # the paper's LCL leaves out samples without knowledge (a data-dependent shape)
    ("fedskc", (("lcl-form", "code"),)): True,
    ("fedsc", ()): False,
    ("fedcosr", ()): False,  # keeps a Python list of per-batch sums
    ("fedprox", ()): True,
    ("moon", ()): True,
    ("scaffold", ()): True,  # a constant offset per gradient, an input of the step
    ("fedopt", ()): True,
    ("fedntd", ()): True,  # the not-true logits by a gather of fixed shape
    ("fedrcl", ()): False,  # its levels come from hooks on each message's model
    ("fedcda", ()): True,  # FedAvg's step; the selection is the server's
    ("local", ()): True,
    ("fedper", ()): True,
    ("fedrep", ()): True,  # a step per phase (head, body)
    ("fedbabu", ()): True,
    ("fedrod", ()): True,  # the label distribution, an input of the step
    ("ditto", ()): True,  # the global model's step; the personal model's runs eagerly
    ("creff", ()): True,  # FedAvg's step; the class gradients are computed before it
    ("lgfedavg", ()): True,
    ("feddistill", ()): True,  # the global logits, an input of the step
    ("fml", ()): False,  # two models in one step, each clipped on its own
    ("fedkd", ()): False,  # three modules in one step
    ("fedgen", ()): False,  # draws labels and noise for the generator on each batch
    ("fedtgp", ()): True,  # FedProto's loss
    ("fedgh", ()): True,
    ("pfedme", ()): False,  # its own inner loop
    ("perfedavg", ()): False,  # its own two half-batch steps
    ("fedamp", ()): True,  # the cloud model, an input of the step
    ("fedala", ()): True,  # CE; the blend weights learn before the training
    ("fedpac", ()): True,  # FedProto's loss, a step per phase
}


def test_each_method_says_whether_its_step_may_be_captured():
    from protofl.task.data import load_client_data

    settings = ExperimentSettings(dataset="digits")
    data = load_client_data("digits", "", settings.partition_spec(2), 0)
    assert {method for method, _ in CAPTURABLE} == set(METHODS)
    for (method, options), capturable in CAPTURABLE.items():
        strategy_class, client_class = get_method(method)
        settings = ExperimentSettings(method=method, dataset="digits", options=dict(options))
        client = client_class(settings, data, build_model("cnn", 1, 10, 16, seed=0), 2, {})
        assert client.options.capturable is capturable, (method, options)
        step = "auto" if capturable else "off"
        assert client.train_kwargs(client.round_of({"server-round": 1}))["cuda_graphs"] == client.precision["cuda_graphs"] == step
        # the server scores the global model in the precision its clients train in
        server_options = strategy_class.options_class.from_settings(settings)
        assert settings.method_precision(server_options) == client.precision


RUN = {"dataset": "digits", "num-server-rounds": 2, "local-epochs": 1, "batch-size": 32}


@pytest.mark.parametrize("method", ["fedproto", "fedsa"] + [pytest.param(m, marks=pytest.mark.slow) for m in (
    "fedprox", "moon", "scaffold", "fedntd")])
def test_a_run_through_the_captured_steps_code_equals_the_plain_run(tmp_path, monkeypatch, method):
    """The client plumbing: prototypes received, loss parts and training-mode prototypes recorded
    on the device, as in the plain loop (FedSA: its three loss parts and during-train prototypes),
    clients after the first of a thread through the step kept from it (FedProx's anchors, MOON's and
    FedNTD's reference models, SCAFFOLD's gradient offsets: the next client's, copied in)."""
    steps, loads = counted_steps(monkeypatch), kept_step_loads(monkeypatch)
    for name, graphs in (("off", "off"), ("static", "static")):
        run_in_process(RUN | {"method": method, "output-dir": str(tmp_path), "run-name": name, "cuda-graphs": graphs},
                       num_nodes=3, one_at_a_time=graphs == "static")
    assert steps, "the static step never ran"
    assert loads, "no client trained through a kept step"
    assert_same_rounds(tmp_path / "static", tmp_path / "off")


# --- on CUDA ------------------------------------------------------------------------------


@pytest.fixture
def float32_on_cuda():
    """True float32 and deterministic kernels: by default cuDNN convolves in TF32 (10-bit
    mantissas) and picks nondeterministic algorithms, and two eager runs differ by a test sample."""
    kept = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic = kept


def captures(monkeypatch):
    """A list of True (captured) / False (the capture failed) per capture attempted."""
    done = []
    original = capture_module.CapturedStep._capture

    def counting(self):
        done.append(original(self))
        return done[-1]

    monkeypatch.setattr(capture_module.CapturedStep, "_capture", counting)
    return done


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_captured_step_trains_as_the_eager_step_on_cuda(monkeypatch, float32_on_cuda, model):
    done = captures(monkeypatch)
    options = {"momentum": 0.9, "weight_decay": 5e-4, "max_grad_norm": 10.0}
    want_weights, want_loss = trained("off", model, "cuda", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns
        got_weights, got_loss = trained("auto", model, "cuda", **options)
    assert done == [True]
    assert got_loss == pytest.approx(want_loss, rel=1e-4)
    for name, tensor in want_weights.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(got_weights[name], tensor, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", ["cnn", "tv-mobilenetv2"])  # the latter with dropout masks fed to the step
def test_a_step_kept_from_one_client_trains_the_next_as_the_eager_step_on_cuda(monkeypatch, float32_on_cuda, model):
    done, loads = captures(monkeypatch), kept_step_loads(monkeypatch)
    want = client_training("off", seed=2, device="cuda", model=model)
    client_training("auto", seed=1, device="cuda", model=model)
    got = client_training("auto", seed=2, device="cuda", model=model)
    assert done == [True] and len(loads) == 1
    assert_same_training(got, want, exact=False)


def rounds(path):
    return json.loads((path / "results.json").read_text())["rounds"]


# FedNH, on an H200 (2026-11-26): rounds 1-2 matched, round 3's float32 PM differed by more than 3
# of 360 test samples; its logits are cos x 30, which amplify rounding differences (cuBLAS on the
# capture's stream). Not yet told apart from a real difference: see docs/results/gpu.md.
FEDNH_ROUND_3 = pytest.mark.xfail(reason="FedNH's round-3 PM differed by >3 samples on an H200", strict=False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", [pytest.param(m, marks=FEDNH_ROUND_3) if m == "fednh" else m for m in sorted(METHODS)])
def test_every_methods_captured_run_matches_its_eager_run_on_cuda(tmp_path, monkeypatch, float32_on_cuda, method):
    """3 rounds: float32 within float tolerance; bfloat16 autocast's PM within 0.5 points, or 3 of
    the 360 test samples the 3 digits clients score."""
    done = captures(monkeypatch)
    config = RUN | {"method": method, "output-dir": str(tmp_path), "num-server-rounds": 3}
    for amp in ("off", "bf16"):
        for graphs in ("off", "auto"):
            run_in_process(config | {"amp": amp, "cuda-graphs": graphs, "run-name": f"{amp}-{graphs}"}, num_nodes=3)
        eager, captured = rounds(tmp_path / f"{amp}-off"), rounds(tmp_path / f"{amp}-auto")
        tolerance = 3 / 360
        for a, b in zip(captured, eager):
            assert abs(a["personalized_accuracy"] - b["personalized_accuracy"]) <= tolerance, (amp, a["round"])
            if amp == "off":
                assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3), a["round"]
    assert all(done) and bool(done) == CAPTURABLE[(method, ())]


@pytest.mark.gpu
@gpu
def test_a_captured_run_resumed_after_round_2_matches_the_uninterrupted_one_on_cuda(tmp_path, float32_on_cuda):
    """FedProto on CUDA (personal models in state files, captured steps): the resumed rounds start
    from the files and from a step captured anew, and score as the rounds that were not interrupted."""
    config = RUN | {"method": "fedproto", "output-dir": str(tmp_path), "num-server-rounds": 4, "amp": "off"}
    run_in_process(config | {"run-name": "whole"})
    run_in_process(config | {"run-name": "parts", "num-server-rounds": 2})
    release_kept_steps()  # as in a new process
    run_in_process(config | {"run-name": "parts", "resume": True})
    assert json.loads((tmp_path / "parts" / "results.json").read_text())["resumed_after"] == [2]
    for a, b in zip(rounds(tmp_path / "parts"), rounds(tmp_path / "whole"), strict=True):
        assert abs(a["personalized_accuracy"] - b["personalized_accuracy"]) <= 3 / 360, a["round"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3), a["round"]
