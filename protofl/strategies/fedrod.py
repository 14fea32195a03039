"""FedRoD (Chen and Chao, ICLR 2022): a generic model trained for the global task, and a
personal head beside it for the client's own.

Client: the body and the generic head g train with the balanced softmax (Eq. 5 of the paper):
cross-entropy of the logits shifted by log p_i(y), p_i the client's training label distribution
(a class it lacks: 1e-12, FedNH's code), so that a skewed client still fits the balanced task. The
personal head p trains with cross-entropy on g(z) + p(z), both terms' inputs detached (Eq. 6):
only p learns from it. ``personal-training = "joint"``: both losses on every mini-batch, one step
(Algorithm 1 of the paper); ``"separate"``: first every epoch of the generic model, then every epoch
of p with the generic model fixed (FedNH's code). Each runs the run's optimiser settings.

``personal-head = "linear"``: p is a linear layer like g (its initial values g's), kept on the
client's node; ``"hyper"``: p's weights are generated from p_i by a hypernetwork (Linear C -> d,
ReLU, Linear d -> d C; the paper's FedRoD (hyper), FedNH's code for CIFAR), which is federated with
the rest.

Server: FedAvg over the generic model (and the hypernetwork); ``weighted = false``: unweighted
(FedNH's code). GM: the generic model (g's logits). PM: g(z) + p(z) (``personal``; ``head``, g alone,
is logged beside it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.client import PrototypeClient
from protofl.settings import ExperimentSettings, KeptModel
from protofl.strategies.families.averaging import ParameterAveraging
from protofl.strategies.families.model_parts import BodyAveraging
from protofl.task.inference import head_prediction
from protofl.task.models import SeededDraws, SplitModel, trainable_only
from protofl.task.sampling import server_seed

PERSONAL_HEAD = "personal_head."
HYPERNETWORK = "hypernetwork."
ABSENT_CLASS_SHARE = 1e-12  # p_i(y) of a class the client lacks (FedNH's code)


@dataclass(frozen=True)
class FedRoDOptions(ParameterAveraging):
    personal_head: Literal["linear", "hyper"] = "linear"
    personal_training: Literal["joint", "separate"] = "joint"

    capturable: ClassVar[bool] = True  # fixed shapes, no host sync

    @property
    def keeps_model(self) -> KeptModel:
        return "trains" if self.personal_head == "linear" else None  # the personal head

    def shares(self, name: str) -> bool:
        return not name.startswith(PERSONAL_HEAD)


class HyperClassifier(nn.Module):
    """p's weights (d x C) from a label distribution (C): Linear(C, d), ReLU, Linear(d, d C)."""

    def __init__(self, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.feature_dim, self.num_classes = feature_dim, num_classes
        self.hidden = nn.Linear(num_classes, feature_dim)
        self.out = nn.Linear(feature_dim, feature_dim * num_classes)

    def forward(self, label_distribution: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.hidden(label_distribution))).view(self.feature_dim, self.num_classes)


def prepare_model(model: SplitModel, settings: ExperimentSettings) -> SplitModel:
    """Add p: a copy of the generic head, or the hypernetwork (its initial values from the run seed's
    server stream, which no backbone draws from)."""
    if FedRoDOptions.from_settings(settings).personal_head == "linear":
        model.personal_head = copy.deepcopy(model.head)
    else:
        with SeededDraws(server_seed(settings.seed, 0)):
            model.hypernetwork = HyperClassifier(model.feature_dim, model.head.out_features)
    return model


def label_distribution(class_counts: np.ndarray) -> torch.Tensor:
    """p_i: the training label shares, ABSENT_CLASS_SHARE for a class the client lacks (before
    normalising, FedNH's code)."""
    counts = torch.as_tensor(class_counts, dtype=torch.float64)
    counts = torch.where(counts > 0, counts, torch.full_like(counts, ABSENT_CLASS_SHARE))
    return counts / counts.sum()


def balanced_softmax_loss(logits: torch.Tensor, labels: torch.Tensor, distribution: torch.Tensor) -> torch.Tensor:
    """Eq. 5: the mean cross-entropy of logits + log p_i."""
    return F.cross_entropy(logits + distribution.log().to(logits.dtype), labels)


class FedRoDStrategy(BodyAveraging):
    options_class = FedRoDOptions
    predictor_names = ("personal", "head")


class FedRoDClient(PrototypeClient):
    options_class = FedRoDOptions
    generic_only = False  # the first phase of personal-training = "separate"

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        self.distribution = label_distribution(self.data.class_counts()).to(self.device)

    def personal_logits(self, features: torch.Tensor) -> torch.Tensor:
        """p(z)."""
        if self.options.personal_head == "linear":
            return self.model.personal_head(features)
        return features @ self.model.hypernetwork(self.distribution.to(features.dtype))

    def personal_parameters(self) -> list[nn.Parameter]:
        module = self.model.personal_head if self.options.personal_head == "linear" else self.model.hypernetwork
        return list(module.parameters())

    def personal_loss(self, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Eq. 6: the cross-entropy of g(z) + p(z), g(z) and z detached: only p learns from it."""
        return F.cross_entropy(logits.detach() + self.personal_logits(features.detach()), labels)

    def local_training(self, this_round):
        if self.options.personal_training == "joint":
            return self.train_model(this_round)
        personal = {id(p) for p in self.personal_parameters()}
        try:  # FedNH's code: every epoch of the generic model, then every epoch of p
            self.generic_only = True
            with trainable_only(self.model, [p for p in self.model.parameters() if id(p) not in personal]):
                self.train_model(this_round, phase="generic")
        finally:
            self.generic_only = False
        with trainable_only(self.model, self.personal_parameters()):
            return self.train_model(this_round, phase="personal",
                                    loss=lambda inputs, features, logits, labels: self.personal_loss(
                                        features, logits, labels))

    def classification_loss(self, logits, labels):
        return balanced_softmax_loss(logits, labels, self.distribution)  # Eq. 5

    def batch_loss(self, features, logits, labels, inputs):
        return None if self.generic_only else self.personal_loss(features, logits, labels)

    def step_constants(self):
        return ()

    def step_inputs(self):
        return {"label-distribution": self.distribution}

    def predictors(self):
        return {"personal": lambda features, logits: (logits + self.personal_logits(features)).argmax(dim=1),
                "head": head_prediction}


STRATEGY, CLIENT = FedRoDStrategy, FedRoDClient
