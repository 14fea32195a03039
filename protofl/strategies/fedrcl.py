"""FedRCL (Seo et al., CVPR 2024): relaxed contrastive learning for federated learning.

Client: the loss of each mini-batch is CE + lambda_scl L_SCL + lambda_pen L_pen, each term the mean
over the model's feature levels of its batch mean, as the authors' code computes it
(``clients/rcl_client.py``, ``utils/loss.py``, skynbe/FedRCL 378beb4). At a level, z_i is sample i's
activation average-pooled over space and L2-normalised, s_ij = z_i . z_j, tau the temperature:

- L_SCL (supervised contrastive, hardest pairs): the positive p_i = min over i's class (itself
  included) of s_ij, the negatives the ``negatives`` (2) most similar samples of other classes;
  loss_i = logsumexp([p_i, s_(i,n1), s_(i,n2)] / tau) - p_i / tau;
- L_pen (the relaxation: a penalty on a class collapsing onto one point): m_i = min over i's other
  class members of s_ij; n_i = m_i when m_i >= ``threshold`` (0.7), else -1; loss_i =
  softplus((n_i - s_ii) / tau). It fires only when every same-class pair of i exceeds the threshold.

Levels (``levels = "all"``): a CIFAR ResNet's stem (its norm's output, before the ReLU, as the
authors') and the last block of each stage; a torchvision ResNet's stem and its four stages; the
CNNs' max-pooling stages and GoogLeNet's four, then the feature. The
authors' ResNet-18 takes its stages before each block's final ReLU, protofl's blocks end in their ReLU
(the code's ``feature_relu`` switch). ``levels = "feature"``: the feature alone, for any backbone.

Server: FedAvg, by training size (the authors' code averages unweighted: ``weighted = false``).
Defaults: tau 0.05, threshold 0.7, 2 negatives, both weights 1 (the authors' CIFAR-10 configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.client import PrototypeClient
from protofl.federation.wire import CONTRASTIVE_LOSS
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.task.models import BasicBlock, SplitModel

PENALTY_LOSS = "penalty-loss"


@dataclass(frozen=True)
class FedRCLOptions(ParameterAveraging):
    lambda_scl: float = 1.0
    lambda_penalty: float = 1.0
    temperature: float = 0.05
    threshold: float = 0.7
    negatives: int = 2
    levels: Literal["all", "feature"] = "all"

    # the levels come from forward hooks, on the model of each message: no step kept across clients
    capturable: ClassVar[bool] = False

    def check(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"fedrcl.temperature must be > 0, got {self.temperature}")
        if self.negatives < 1:
            raise ValueError(f"fedrcl.negatives must be >= 1, got {self.negatives}")
        for key, value in (("lambda-scl", self.lambda_scl), ("lambda-penalty", self.lambda_penalty)):
            if value < 0:
                raise ValueError(f"fedrcl.{key} must be >= 0, got {value}")


def feature_levels(model: SplitModel, levels: str = "all") -> list[nn.Module]:
    """The modules whose outputs are the feature levels of ``model`` (the body itself last, for the
    feature); raises ValueError for a backbone whose levels are unknown."""
    if levels == "feature":
        return [model.body]
    modules = list(model.body.modules())
    vision = next((m for m in modules if hasattr(m, "layer4") and hasattr(m, "bn1")), None)
    if vision is not None:  # a torchvision ResNet
        return [vision.bn1, vision.layer1, vision.layer2, vision.layer3, vision.layer4]
    inception = next((m for m in modules if hasattr(m, "inception5b")), None)
    if inception is not None:  # torchvision's GoogLeNet: its four max-pooling stages, then the feature
        return [inception.maxpool1, inception.maxpool2, inception.maxpool3, inception.maxpool4, model.body]
    blocks = [m for m in modules if isinstance(m, BasicBlock)]
    if blocks:  # a CIFAR ResNet: its stem's norm, then each stage's last block
        stem = next(m for m in modules if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)))
        return [stem] + [b for b, after in zip(blocks, blocks[1:] + [None])
                         if after is None or after.conv1.out_channels != b.conv2.out_channels
                         or after.conv1.stride != (1, 1)]
    pools = [m for m in modules if isinstance(m, nn.MaxPool2d)]
    if pools:  # a CNN: each max-pooling stage, then the feature
        return pools + [model.body]
    raise ValueError("fedrcl.levels='all' knows the ResNets and backbones with max-pooling stages; set "
                     "fedrcl.levels='feature' for this backbone")


def relaxed_contrastive_terms(
    activations: torch.Tensor, labels: torch.Tensor, temperature: float, threshold: float, negatives: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_SCL, L_pen) of one level, each per sample (see the module's docstring)."""
    pooled = activations.flatten(2).mean(dim=2) if activations.dim() > 2 else activations
    z = F.normalize(pooled, p=2, dim=1)
    similarity = z @ z.T
    same = labels[:, None] == labels[None, :]
    own = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    infinity = torch.tensor(float("inf"), dtype=similarity.dtype, device=similarity.device)
    positive = similarity.masked_fill(~same, infinity).topk(1, dim=1, largest=False).values
    hardest = similarity.masked_fill(same, -infinity).topk(min(negatives, len(labels)), dim=1).values
    pairs = torch.cat([positive, hardest], dim=1) / temperature
    contrastive = torch.logsumexp(pairs, dim=1) - pairs[:, 0]
    partner = similarity.masked_fill(~same | own, infinity).topk(1, dim=1, largest=False).values[:, 0]
    relaxed = torch.where(torch.isinf(partner) | (partner < threshold), -torch.ones_like(partner), partner)
    penalty = F.softplus((relaxed - similarity.diagonal()) / temperature)
    return contrastive, penalty


class FedRCLStrategy(AveragingStrategy):
    options_class = FedRCLOptions
    loss_metrics = (CONTRASTIVE_LOSS, PENALTY_LOSS)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        feature_levels(self.model, self.options.levels)  # an unknown backbone: one clear error before round 1


class FedRCLClient(PrototypeClient):
    options_class = FedRCLOptions

    def local_training(self, this_round):
        """The round's training with a hook on each feature level, removed after it (the model is
        the process's kept one: the next message's client must not find them)."""
        self.activations: list[torch.Tensor] = []
        # a copy of each level's output as its module gave it: an in-place ReLU after a stem's norm
        # would change the tensor itself before the loss reads it
        hooks = [m.register_forward_hook(lambda _m, _in, out: self.activations.append(out.clone()))
                 for m in feature_levels(self.model, self.options.levels)]
        try:
            return self.train_model(this_round)
        finally:
            for hook in hooks:
                hook.remove()

    def batch_loss(self, features, logits, labels, inputs):
        o = self.options
        terms = [relaxed_contrastive_terms(level, labels, o.temperature, o.threshold, o.negatives)
                 for level in self.activations]
        self.activations.clear()  # this batch's, taken
        contrastive = torch.stack([c.mean() for c, _ in terms]).mean()
        penalty = torch.stack([p.mean() for _, p in terms]).mean()
        self.record_loss(**{CONTRASTIVE_LOSS: contrastive, PENALTY_LOSS: penalty})
        return o.lambda_scl * contrastive + o.lambda_penalty * penalty


STRATEGY, CLIENT = FedRCLStrategy, FedRCLClient
