"""FML (Shen et al., 2020): federated mutual learning. Each client trains its own model (any
architecture, kept on its node) together with a shared "meme" model (one architecture on every
client: the model family's first), each distilling into the other.

Client, each mini-batch (HtFLlib's form): L_own = alpha CE(z, y) + (1 - alpha) KL(p_meme || p_own) and
L_meme = beta CE(z_meme, y) + (1 - beta) KL(p_own || p_meme) (Eq. 1-2), KL averaged over the batch
and the classes (``nn.KLDivLoss()``'s mean); both models step on the gradient of L_own + L_meme (the
two backward passes of HtFLlib's code accumulate so), each model's gradient clipped to norm 10 on its
own (``max-grad-norm = "auto"``). The meme, received each round, goes up; the own model stays.
alpha = beta = 0.5 (FedSA's scripts).

Server: the memes averaged, unweighted (``weighted = false``, HtFLlib's). GM: the meme on the global
test set. PM: the client's own model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.client import PrototypeClient
from protofl.settings import KeptModel
from protofl.strategies.fedavg import FedAvgStrategy, ParameterAveraging
from protofl.task.models import SplitModel, build_model, client_architecture
from protofl.task.precision import uses_channels_last

SHARED_LOSS = "shared-model-loss"  # L_meme's batch mean (FedKD: the mentee's loss)


@dataclass(frozen=True)
class SecondModel(ParameterAveraging):
    """A method whose clients share a second model beside their own (FML, FedKD)."""

    keeps_model: ClassVar[KeptModel] = "trains"  # the own model; the shared one is received
    shares_across_architectures: ClassVar[bool] = True  # the shared model has one architecture
    max_grad_norm: ClassVar[float] = 10.0  # each model's (HtFLlib's)
    weighted: bool = False


@dataclass(frozen=True)
class FMLOptions(SecondModel):
    alpha: float = 0.5
    beta: float = 0.5

    def check(self) -> None:
        for key in ("alpha", "beta"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"fml.{key} must be in [0, 1], got {getattr(self, key)}")


class MutualModels(nn.Module):
    """Models trained together in one training loop: the first one's outputs go to the loss, which
    runs the others."""

    def __init__(self, *models: nn.Module) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x: torch.Tensor):
        return self.models[0](x)

    @property
    def channels_last_faster(self) -> tuple[str, ...]:
        """The devices where every backbone among them trains faster channels-last."""
        kinds = [set(m.channels_last_faster) for m in self.models if hasattr(m, "channels_last_faster")]
        return tuple(set.intersection(*kinds)) if kinds else ()


def mean_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) averaged over the batch and the classes (``nn.KLDivLoss()``
    on log-probabilities and probabilities)."""
    target = target_logits.softmax(dim=1)
    return (torch.xlogy(target, target) - target * logits.log_softmax(dim=1)).mean()


def mutual_loss(logits: torch.Tensor, other_logits: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """Eq. 1 (2): weight CE(logits, y) + (1 - weight) KL(p_other || p)."""
    return weight * F.cross_entropy(logits, labels) + (1 - weight) * mean_kl(logits, other_logits)


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class SecondModelClient(PrototypeClient):
    """A client that trains the shared model beside its own, in one loop (FML's, FedKD's)."""

    def exchanged_model(self) -> SplitModel:
        """The family's first architecture (the server's model) for every client."""
        d, s = self.data, self.settings
        model = build_model(client_architecture(s.model, 0), d.in_channels, d.num_classes, d.image_size, s.seed)
        return model.to(self.device, next(self.model.parameters()).dtype)

    def train_together(self, config, loss, *extra: nn.Module) -> float:
        """Both models (and ``extra`` modules) trained on ``loss``, each one's gradient clipped alone."""
        models = (self.model, self.exchanged, *extra)
        together = MutualModels(*models)
        precision = self.precision
        if not uses_channels_last(together, precision["channels_last"], self.device, precision["cuda_graphs"]):
            together.to(memory_format=torch.contiguous_format)  # not as an earlier pass left one of them
        return self.train_model(config, model=together, loss=loss, clip_groups=[trainable(m) for m in models])


class FMLStrategy(FedAvgStrategy):
    options_class = FMLOptions
    loss_metrics = (SHARED_LOSS,)


class FMLClient(SecondModelClient):
    options_class = FMLOptions

    def local_training(self, config):
        o = self.options

        def loss(inputs, features, logits, labels):
            _, shared_logits = self.exchanged(inputs)
            shared_loss = mutual_loss(shared_logits, logits, labels, o.beta)
            self.record_loss(**{SHARED_LOSS: shared_loss})
            return mutual_loss(logits, shared_logits, labels, o.alpha) + shared_loss

        return self.train_together(config, loss)


STRATEGY, CLIENT = FMLStrategy, FMLClient
