"""Backbones that return ``(features, logits)``.

Every model is a ``body`` (input -> feature vector) followed by a ``head`` (feature -> logits),
so prototype methods can reach the feature space and swap or freeze the head.
"""

from __future__ import annotations

import torch
from torch import nn


class SplitModel(nn.Module):
    """body -> features -> head -> logits."""

    def __init__(self, body: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return features, self.head(features)


def cnn(in_channels: int, num_classes: int, image_size: int, feature_dim: int = 512) -> SplitModel:
    """FedAvgCNN (PFLlib): 2 x [conv5x5, ReLU, maxpool2], Linear(-> 512), ReLU, Linear(-> C).

    The flattened size follows the input: 1600 for 32x32x3, 1024 for 28x28x1, 64 for 16x16x1.
    """
    conv = nn.Sequential(
        nn.Conv2d(in_channels, 32, kernel_size=5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    with torch.no_grad():
        flat = conv(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
    body = nn.Sequential(conv, nn.Linear(flat, feature_dim), nn.ReLU(inplace=True))
    return SplitModel(body, nn.Linear(feature_dim, num_classes), feature_dim)


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(in_channels: int, num_classes: int, image_size: int = 32) -> SplitModel:
    """ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool), 512-d feature."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
    ]
    in_planes = 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)]
        in_planes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return SplitModel(nn.Sequential(*layers), nn.Linear(512, num_classes), 512)


MODELS = {"cnn": cnn, "resnet18": resnet18}


def build_model(name: str, in_channels: int, num_classes: int, image_size: int, seed: int) -> SplitModel:
    """A freshly initialised model; the same seed gives the same weights everywhere."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](in_channels, num_classes, image_size)
