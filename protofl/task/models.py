"""Backbones that return ``(features, logits)``.

Every model is a ``body`` (input -> feature vector) followed by a ``head`` (feature -> logits),
so prototype methods can reach the feature space and swap or freeze the head.

A *model family* (``htfe2`` ... ``htfe8``, FedSA/FedTGP's heterogeneous settings) names one
architecture per client: client i gets the family's architecture i mod X.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from protofl.task.augment import drawn_to


class SplitModel(nn.Module):
    """body -> features -> head -> logits. ``channels_last_faster``: the kinds of device ("cpu",
    "cuda") on which the backbone trains faster with its image batches in channels-last memory
    order (``channels-last="auto"``)."""

    channels_last_faster: frozenset[str] = frozenset()

    def __init__(self, body: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return features, self.head(features)


def _conv_features(in_channels: int, image_size: int, widths: tuple[int, int]) -> tuple[nn.Module, int]:
    """2 x [conv5x5 (no padding), ReLU, maxpool2], flattened; returns (module, flattened size)."""
    conv = nn.Sequential(
        nn.Conv2d(in_channels, widths[0], kernel_size=5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(widths[0], widths[1], kernel_size=5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    side = ((image_size - 4) // 2 - 4) // 2  # each conv5x5 takes 4 pixels, each pool halves, rounding down
    if side < 1:
        raise ValueError(f"a {image_size}x{image_size} image is too small for two conv5x5 + maxpool2 layers")
    # computed, not by a forward pass: on torch's meta device (model_bytes) that imports sympy, ~1 CPU-second
    return conv, widths[1] * side * side


def cnn(in_channels: int, num_classes: int, image_size: int, feature_dim: int = 512) -> SplitModel:
    """FedAvgCNN (PFLlib): 2 x [conv5x5, ReLU, maxpool2], Linear(-> 512), ReLU, Linear(-> C).

    The flattened size follows the input: 1600 for 32x32x3, 1024 for 28x28x1, 64 for 16x16x1.
    """
    conv, flat = _conv_features(in_channels, image_size, (32, 64))
    body = nn.Sequential(conv, nn.Linear(flat, feature_dim), nn.ReLU(inplace=True))
    return SplitModel(body, nn.Linear(feature_dim, num_classes), feature_dim)


def fednh_cnn(in_channels: int, num_classes: int, image_size: int) -> SplitModel:
    """The CNN of FedNH and FedROD ("Conv2Cifar"), 192-d non-negative feature.

    2 x [conv5x5(64), ReLU, maxpool2], Linear(-> 384), ReLU, Linear(-> 192), ReLU; the head is
    Linear(192, C) without bias, as for every method in FedNH's experiments.
    """
    conv, flat = _conv_features(in_channels, image_size, (64, 64))
    body = nn.Sequential(
        conv, nn.Linear(flat, 384), nn.ReLU(inplace=True), nn.Linear(384, 192), nn.ReLU(inplace=True)
    )
    return SplitModel(body, nn.Linear(192, num_classes, bias=False), 192)


Norm = Callable[[int], nn.Module]


def group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(2, channels)


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int, norm: Norm = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), norm(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def _cifar_resnet_body(in_channels: int, norm: Norm, stages: tuple[tuple[int, int, int], ...]) -> nn.Module:
    """CIFAR stem (3x3 conv, stride 1, no max-pool), then (planes, stride, blocks) stages of
    BasicBlocks, global average pool: a feature of the last stage's width."""
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), norm(64), nn.ReLU(inplace=True)]
    in_planes = 64
    for planes, stride, blocks in stages:
        layers += [BasicBlock(in_planes, planes, stride, norm)]
        layers += [BasicBlock(planes, planes, 1, norm) for _ in range(blocks - 1)]
        in_planes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers)


RESNET18_STAGES = ((64, 1, 2), (128, 2, 2), (256, 2, 2), (512, 2, 2))


def resnet18(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """ResNet-18 with the CIFAR stem and BatchNorm, 512-d feature, Linear(512, C) head."""
    body = _cifar_resnet_body(in_channels, nn.BatchNorm2d, RESNET18_STAGES)
    return SplitModel(body, nn.Linear(512, num_classes), 512)


def resnet18_gn(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """FedNH's ResNet-18: GroupNorm(2 groups) instead of BatchNorm, bias-free Linear(512, C) head."""
    body = _cifar_resnet_body(in_channels, group_norm, RESNET18_STAGES)
    return SplitModel(body, nn.Linear(512, num_classes, bias=False), 512)


def resnet10(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """FedSC's ResNet-10: the CIFAR stem and one BasicBlock per stage (64, 128, 256, 512), 512-d
    non-negative feature, Linear(512, C) head, PyTorch's default initialisation."""
    body = _cifar_resnet_body(in_channels, nn.BatchNorm2d, ((64, 1, 1), (128, 2, 1), (256, 2, 1), (512, 2, 1)))
    return SplitModel(body, nn.Linear(512, num_classes), 512)


def resnet8_x4(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """FedSKC's ResNet-8 at 4x width: the CIFAR stem and one BasicBlock per stage (64, 128, 256),
    256-d feature, Linear(256, C) head; convolutions drawn from N(0, 2 / (k^2 out_channels))."""
    body = _cifar_resnet_body(in_channels, nn.BatchNorm2d, ((64, 1, 1), (128, 2, 1), (256, 2, 1)))
    for module in body.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return SplitModel(body, nn.Linear(256, num_classes), 256)


class FeaturePool(nn.Module):
    """Average-pools a flat feature vector to ``dim`` values (FedSA/HtFLlib's ``AdaptiveAvgPool1d``
    after each extractor: 2048 -> 512 averages groups of 4); the identity when the size is ``dim``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return x if x.shape[1] == self.dim else F.adaptive_avg_pool1d(x.unsqueeze(1), self.dim).squeeze(1)


class SeededDropout(nn.Module):
    """``nn.Dropout(p)`` whose masks come from its own CPU generator, which :func:`seed_dropout`
    seeds from the client's seed before training, not from torch's global one: a client's masks
    are the same on any thread, process or node. A captured step cannot draw (a replay would reuse
    its first masks): the training loop draws each step's mask beforehand with :meth:`draw`, the same
    draw, and the step feeds it to the layer (``fed``) from its static buffers."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.generator = torch.Generator()
        self.sample_shape: torch.Size | None = None  # of one sample of the last training input
        self.fed: torch.Tensor | None = None  # this step's mask, drawn before the step

    def draw(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The next mask for an input of ``shape``, on ``device``."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("SeededDropout draws on the host: feed a captured step its masks")
        return drawn_to(torch.rand(shape, generator=self.generator) >= self.p, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        self.sample_shape = x.shape[1:]
        kept = self.fed if self.fed is not None else self.draw(x.shape, x.device)
        return x * kept / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def seeded_dropout(net: nn.Module) -> nn.Module:
    """``net`` with each ``nn.Dropout`` replaced by a :class:`SeededDropout` of the same ``p``."""
    for name, child in net.named_children():
        setattr(net, name, SeededDropout(child.p) if type(child) is nn.Dropout else seeded_dropout(child))
    return net


def seed_dropout(model: nn.Module, generator: torch.Generator) -> None:
    """Seeds each :class:`SeededDropout` of ``model`` from ``generator`` (a client's; no draw without one)."""
    for layer in model.modules():
        if isinstance(layer, SeededDropout):
            layer.generator.manual_seed(int(torch.randint(2**62, (), generator=generator)))


def host_dropouts(model: nn.Module) -> list[SeededDropout]:
    """The :class:`SeededDropout` layers of ``model`` that draw masks (p > 0), in module order."""
    return [m for m in model.modules() if isinstance(m, SeededDropout) and m.p > 0]


def next_masks(drawing: list[SeededDropout], shaped: list[SeededDropout], batch_size: int,
               device: torch.device) -> list[torch.Tensor]:
    """The next dropout masks for a batch of ``batch_size``: drawn by ``drawing`` (a client's layers,
    seeded for it), shaped as the last inputs of ``shaped`` (the layers of the step they go to);
    none before every one of those has seen an input (the layers then draw themselves)."""
    shapes = [layer.sample_shape for layer in shaped]
    if any(shape is None for shape in shapes):
        return []
    return [layer.draw((batch_size, *shape), device) for layer, shape in zip(drawing, shapes)]


@contextlib.contextmanager
def fed_masks(layers: list[SeededDropout], masks: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within: each of ``layers`` uses its mask of ``masks`` instead of drawing (none given: they draw)."""
    for layer, mask in zip(layers, masks):
        layer.fed = mask
    try:
        yield
    finally:
        for layer in layers:
            layer.fed = None


def _new_stem(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """``conv`` rebuilt for ``in_channels`` inputs (grey-scale data), Kaiming-initialised."""
    stem = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, bias=False)
    nn.init.kaiming_normal_(stem.weight, mode="fan_out", nonlinearity="relu")
    return stem


def _torchvision_split(net: nn.Module, classifier: str, num_classes: int, feature_dim: int = 512) -> SplitModel:
    """torchvision ``net`` with its final ``classifier`` Linear replaced by a pool to ``feature_dim``
    (inside the body, after the model's own dropout), and a Linear(feature_dim, C) head."""
    parent = net
    *path, last = classifier.split(".")
    for name in path:
        parent = getattr(parent, name)
    setattr(parent, last, nn.Identity())
    body = nn.Sequential(seeded_dropout(net), FeaturePool(feature_dim))
    return SplitModel(body, nn.Linear(feature_dim, num_classes), feature_dim)


def _imagenet_resnet(block: str, layers: list[int]) -> Callable[[int, int, int], SplitModel]:
    """torchvision ResNet (``block``: "BasicBlock" or "Bottleneck") with its unmodified ImageNet
    stem (7x7 stride-2 conv + max-pool), as HtFLlib uses even on 32x32 inputs; the pooled feature
    (512, or 2048 -> 512) is the feature."""

    def build(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
        from torchvision.models import resnet  # torchvision's import costs ~1.6 s: only where it is used

        net = resnet.ResNet(getattr(resnet, block), layers)
        if in_channels != 3:
            net.conv1 = _new_stem(net.conv1, in_channels)
        return _torchvision_split(net, "fc", num_classes)

    return build


def googlenet(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """torchvision GoogLeNet without auxiliary heads; 1024 -> 512 pooled feature after its dropout."""
    import torchvision

    net = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True)
    if in_channels != 3:
        net.conv1.conv = _new_stem(net.conv1.conv, in_channels)
    return _torchvision_split(net, "fc", num_classes)


def mobilenet_v2(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """torchvision MobileNetV2 (width 1.0, 1280 channels, dropout 0.2); 1280 -> 512 pooled feature."""
    import torchvision

    net = torchvision.models.mobilenet_v2(weights=None)
    if in_channels != 3:
        net.features[0][0] = _new_stem(net.features[0][0], in_channels)
    return _torchvision_split(net, "classifier.1", num_classes)


_BASIC, _BOTTLENECK = "BasicBlock", "Bottleneck"

MODELS = {
    "cnn": cnn,
    "fednh-cnn": fednh_cnn,
    "resnet18": resnet18,
    "resnet18-gn": resnet18_gn,
    "resnet10": resnet10,  # FedSC
    "resnet8-x4": resnet8_x4,  # FedSKC
    # ImageNet-stem torchvision backbones of the heterogeneous settings, all with 512-d features
    "tv-resnet10": _imagenet_resnet(_BASIC, [1, 1, 1, 1]),
    "tv-resnet18": _imagenet_resnet(_BASIC, [2, 2, 2, 2]),
    "tv-resnet34": _imagenet_resnet(_BASIC, [3, 4, 6, 3]),
    "tv-resnet50": _imagenet_resnet(_BOTTLENECK, [3, 4, 6, 3]),
    "tv-resnet101": _imagenet_resnet(_BOTTLENECK, [3, 4, 23, 3]),
    "tv-resnet152": _imagenet_resnet(_BOTTLENECK, [3, 8, 36, 3]),
    "tv-googlenet": googlenet,
    "tv-mobilenetv2": mobilenet_v2,
}

# The backbones whose training (float32, on a CPU) measured faster with channels-last image batches
# than with NCHW ones at Fashion-MNIST's and CIFAR's image sizes (1.02-1.33x; resnet10 0.92x at batch
# 10 on CIFAR, 1.11x at its presets' 64), benchmarks/throughput.py, docs/results/speed.md: what
# channels-last="auto" puts in channels-last order. The ImageNet-stem ResNets measured 1.3-1.9x
# slower in it; the others are unmeasured and stay NCHW.
CHANNELS_LAST_FASTER = frozenset({"cnn", "fednh-cnn", "resnet8-x4", "resnet10", "resnet18", "tv-googlenet",
                                  "tv-mobilenetv2"})
# On CUDA, with captured training steps and bfloat16 autocast (amp="auto" there), on an H200 at batch
# 64 on CIFAR's shapes: channels-last 1.06-1.39x faster than NCHW for these (docs/results/gpu.md);
# tv-mobilenetv2 (0.96x) and resnet18-gn (0.92x) stay NCHW, tv-resnet101/152 are unmeasured. Eager
# CUDA steps run NCHW float32 (channels-last was 0.95-0.99x for the CNNs and GoogLeNet).
CHANNELS_LAST_FASTER_CUDA = frozenset({"cnn", "fednh-cnn", "resnet8-x4", "resnet10", "resnet18", "tv-googlenet",
                                       "tv-resnet10", "tv-resnet18", "tv-resnet34", "tv-resnet50"})

# FedSA's (and FedTGP's) model-heterogeneous settings: client i gets architecture i mod X.
MODEL_FAMILIES = {
    "htfe2": ("cnn", "tv-resnet18"),
    "htfe3": ("tv-resnet10", "tv-resnet18", "tv-resnet34"),
    "htfe5": ("cnn", "tv-resnet10", "tv-resnet18", "tv-resnet34", "tv-resnet50"),
    "htfe8": (
        "cnn", "tv-googlenet", "tv-mobilenetv2", "tv-resnet18", "tv-resnet34", "tv-resnet50", "tv-resnet101",
        "tv-resnet152",
    ),
}


def client_architecture(model: str, partition_id: int) -> str:
    """The architecture a client builds: ``model`` itself, or for a family its (id mod X)-th member."""
    if model in MODEL_FAMILIES:
        family = MODEL_FAMILIES[model]
        return family[partition_id % len(family)]
    return model


# torch's functions that draw random numbers and take a ``generator`` (module constructors and
# torchvision call the nn.init ones, and those the tensor methods)
_RANDOM_DRAWS = frozenset({
    "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "rand", "randn", "randint", "randperm",
    "normal", "bernoulli", "multinomial", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "trunc_normal_", "orthogonal_", "sparse_",
})


class SeededDraws(TorchFunctionMode):
    """``with SeededDraws(seed):``, every random draw of torch in this thread that would use the
    global generator uses a generator of its own, seeded with ``seed``, instead: the same draws as
    after ``torch.manual_seed(seed)`` (both are the CPU's Mersenne Twister), but neither read nor
    moved by other threads (torch function modes are per thread). So models built on threads
    (Flower's thread pool, in-process federations) equal those built in separate processes."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") in _RANDOM_DRAWS and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


def model_bytes(name: str, in_channels: int, num_classes: int, image_size: int) -> int:
    """The bytes of model ``name``'s parameters and buffers: :func:`build_model` on torch's meta
    device (no memory, no initialisation)."""
    with torch.device("meta"):
        model = build_model(name, in_channels, num_classes, image_size, seed=0)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def build_model(name: str, in_channels: int, num_classes: int, image_size: int, seed: int) -> SplitModel:
    """A freshly initialised model; the same seed gives the same weights everywhere, on any thread."""
    if name not in MODELS:
        known = sorted(MODELS) + sorted(MODEL_FAMILIES)
        raise ValueError(f"model must be one of {known}, got {name!r}")
    with SeededDraws(seed):
        model = MODELS[name](in_channels, num_classes, image_size)
    faster_on = {"cpu": CHANNELS_LAST_FASTER, "cuda": CHANNELS_LAST_FASTER_CUDA}
    model.channels_last_faster = frozenset(device for device, names in faster_on.items() if name in names)
    return model


@contextlib.contextmanager
def trainable_only(model: nn.Module, parameters: Iterable[nn.Parameter]) -> Iterator[None]:
    """Within, of ``model``'s parameters exactly ``parameters`` are trainable: a phase of local
    training (FedRep's head, then its body; FedBABU's fine-tuning of its frozen head). Each
    parameter's ``requires_grad`` is put back on leaving."""
    before = {id(p): p.requires_grad for p in model.parameters()}
    chosen = {id(p) for p in parameters}
    try:
        for p in model.parameters():
            p.requires_grad_(id(p) in chosen)
        yield
    finally:
        for p in model.parameters():
            p.requires_grad_(before[id(p)])
