import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from protofl.task.models import SeededDropout, SplitModel, build_model, model_bytes
from protofl.task.train import train


@pytest.mark.parametrize(
    "name,channels,size,classes,dim",
    [
        ("cnn", 1, 16, 10, 512),
        ("cnn", 1, 28, 10, 512),
        ("cnn", 3, 32, 100, 512),
        ("fednh-cnn", 3, 32, 10, 192),
        ("fednh-cnn", 1, 28, 10, 192),
        ("resnet18", 3, 32, 10, 512),
        ("resnet18", 1, 28, 10, 512),
        ("resnet18-gn", 3, 32, 200, 512),
        ("resnet10", 3, 32, 10, 512),
        ("resnet8-x4", 3, 32, 100, 256),
    ],
)
def test_models_return_features_and_logits(name, channels, size, classes, dim):
    model = build_model(name, channels, classes, size, seed=0)
    features, logits = model(torch.randn(4, channels, size, size))
    assert features.shape == (4, dim) and logits.shape == (4, classes)
    assert model.feature_dim == dim
    assert torch.equal(model.head(features), logits)


def test_fednh_backbones_match_the_paper():
    conv2cifar = build_model("fednh-cnn", 3, 10, 32, seed=0)
    # 5x5 convs without padding: 32 -> 28 -> 14 -> 10 -> 5, so 64 * 5 * 5 = 1600 inputs to FC 384
    assert [m.in_features for m in conv2cifar.body.modules() if isinstance(m, nn.Linear)] == [1600, 384]
    assert conv2cifar.head.bias is None
    features, _ = conv2cifar(torch.randn(8, 3, 32, 32))
    assert (features >= 0).all()  # ReLU before the head
    resnet = build_model("resnet18-gn", 3, 200, 64, seed=0)
    norms = [m for m in resnet.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]
    assert norms and all(isinstance(m, nn.GroupNorm) and m.num_groups == 2 for m in norms)
    assert resnet.head.bias is None and sum(p.numel() for p in resnet.parameters()) > 11_000_000


def test_same_seed_same_initial_weights():
    a, b, c = (build_model("cnn", 1, 10, 28, seed=s) for s in (1, 1, 2))
    for (name, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), name
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


@pytest.mark.parametrize("name", ["cnn", "resnet8-x4", "tv-resnet10"])
def test_models_built_on_threads_equal_those_built_alone(name):
    """Clients on threads (Flower's thread pool) build their models while other threads draw random
    numbers: each model is still the one its seed gives in a process of its own, and the global
    generator is neither read nor moved."""
    alone = {seed: build_model(name, 1, 10, 28, seed) for seed in (0, 1)}
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    stop = threading.Event()

    def draw_meanwhile():
        while not stop.is_set():
            torch.randn(64, generator=torch.Generator())  # busy, without touching the global generator
            torch.randn(64)

    busy = threading.Thread(target=draw_meanwhile)
    busy.start()
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            built = list(pool.map(lambda i: (i % 2, build_model(name, 1, 10, 28, i % 2)), range(6)))
    finally:
        stop.set()
        busy.join()
    for seed, model in built:
        for (key, got), want in zip(model.state_dict().items(), alone[seed].state_dict().values()):
            assert torch.equal(got, want), key
    torch.manual_seed(123)
    build_model(name, 1, 10, 28, 5)
    assert torch.equal(torch.rand(1), expected_next)


@pytest.mark.parametrize("name, channels, size", [("cnn", 1, 16), ("resnet18-gn", 3, 32), ("tv-googlenet", 3, 32)])
def test_model_bytes_without_building_equal_the_built_models(name, channels, size):
    model = build_model(name, channels, 10, size, seed=0)
    tensors = [*model.parameters(), *model.buffers()]
    assert model_bytes(name, channels, 10, size) == sum(t.numel() * t.element_size() for t in tensors)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("vgg", 3, 10, 32, seed=0)


def test_gradient_clipping_bounds_each_step():
    from protofl.task.train import train

    x, y = torch.randn(32, 1, 16, 16), torch.randint(0, 10, (32,))

    def step_norm(max_grad_norm):
        model = build_model("cnn", 1, 10, 16, seed=0)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        train(model, x, y, epochs=1, batch_size=32, lr=1.0, seed=0, max_grad_norm=max_grad_norm)  # one SGD step
        return (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm().item()

    assert step_norm(0.01) == pytest.approx(0.01, rel=1e-3)
    assert step_norm(0.0) > 0.05


@pytest.mark.parametrize(
    "name,channels,size",
    [("tv-resnet10", 1, 28), ("tv-resnet18", 3, 32), ("tv-resnet50", 1, 28), ("tv-googlenet", 3, 32),
     ("tv-mobilenetv2", 1, 28)],
)
def test_heterogeneous_backbones_end_in_a_512_d_feature_and_a_linear_head(name, channels, size):
    model = build_model(name, channels, 10, size, seed=0)
    features, logits = model.train()(torch.randn(4, channels, size, size))
    assert features.shape == (4, 512) and logits.shape == (4, 10) and model.feature_dim == 512
    assert isinstance(model.head, nn.Linear) and model.head.bias is not None
    stem = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert stem.in_channels == channels
    if name.startswith("tv-resnet"):
        assert stem.kernel_size == (7, 7) and stem.stride == (2, 2)  # the unmodified ImageNet stem


def test_feature_pool_averages_groups_of_consecutive_channels():
    from protofl.task.models import FeaturePool

    pooled = FeaturePool(512)(torch.arange(2048.0).reshape(1, 2048))
    assert pooled.shape == (1, 512) and pooled[0, 0] == 1.5 and pooled[0, 511] == 2045.5  # mean of 4
    x = torch.randn(2, 512)
    assert torch.equal(FeaturePool(512)(x), x)


def test_a_model_family_gives_client_i_architecture_i_mod_x():
    from protofl.task.models import MODEL_FAMILIES, client_architecture

    assert [client_architecture("htfe2", i) for i in range(4)] == ["cnn", "tv-resnet18"] * 2
    assert client_architecture("htfe8", 10) == MODEL_FAMILIES["htfe8"][2] == "tv-mobilenetv2"
    assert client_architecture("cnn", 7) == "cnn"
    from protofl.task.models import MODELS

    assert all(name in MODELS for family in MODEL_FAMILIES.values() for name in family)


def test_fedsc_and_fedskc_resnets_have_one_block_per_stage():
    def blocks(model):
        return [m for m in model.modules() if type(m).__name__ == "BasicBlock"]

    resnet10, resnet8 = build_model("resnet10", 3, 10, 32, seed=0), build_model("resnet8-x4", 3, 10, 32, seed=0)
    assert [b.conv1.out_channels for b in blocks(resnet10)] == [64, 128, 256, 512]
    assert [b.conv1.out_channels for b in blocks(resnet8)] == [64, 128, 256]
    features, _ = resnet10(torch.randn(2, 3, 32, 32))
    assert (features >= 0).all()  # post-ReLU, pooled
    conv = blocks(resnet8)[2].conv2  # N(0, 2 / (3 * 3 * 256)): std 0.0295
    assert conv.weight.std().item() == pytest.approx((2 / (9 * 256)) ** 0.5, rel=0.05)


def test_dropout_masks_come_from_the_clients_seed_not_the_process():
    """Training with dropout repeats exactly whatever torch's global generator holds (another
    thread's draws, another process's or node's history); without dropout it trains otherwise."""
    x, y = torch.randn(8, 12), torch.arange(8) % 3

    def trained(global_seed, p=0.5):
        torch.manual_seed(0)
        model = SplitModel(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), SeededDropout(p)), nn.Linear(16, 3), 16)
        torch.manual_seed(global_seed)
        train(model, x, y, epochs=1, batch_size=4, lr=0.1, seed=0)
        return model.head.weight.detach().clone()

    first = trained(1)
    assert torch.equal(trained(2), first)
    assert not torch.equal(trained(1, p=0.0), first)


@pytest.mark.parametrize("name", ["tv-googlenet", "tv-mobilenetv2"])
def test_the_torchvision_backbones_with_dropout_draw_their_masks_so(name):
    """Their dropout is SeededDropout (tests/test_capture.py: its masks go into a captured step)."""
    with torch.device("meta"):
        model = build_model(name, 3, 10, 32, seed=0)
    assert any(isinstance(m, SeededDropout) for m in model.modules())
    assert not any(type(m) is nn.Dropout for m in model.modules())
