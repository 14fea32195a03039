"""FedSA (Zhou et al., AAAI 2025): semantic anchors for prototype-based FL.

No model parameters are exchanged, so every client may run its own architecture (``model =
"htfe2"`` ... ``"htfe8"``, or a node's ``model`` node-config value); all must give D-dim features.

Server: semantic anchors A^0 drawn once from the run seed: Gaussian class vectors through an
untrained Linear-BN-ReLU x2 embedding (``anchor-init = "projected"``; ``"random"`` is Table 4's
"no ER" row). Each round, the global prototype of each class uploaded this round is the
unweighted mean over its uploaders (``proto-agg = "mean"``, the official code; ``"weighted"`` by
class counts), and those classes' anchors move by EMA A <- alpha A + (1 - alpha) P (Eq. 10,
alpha = 0.9999). Anchors and global prototypes go out as bytes in the fit and evaluate config.

Client: its own persistent model (``context.state``). Loss per mini-batch
CE + lambda_r L_R + lambda_mcl L_MCL + lambda_cc L_CC with, in the official code's per-sample
forms (spec section 9, the default), L_R = MSE(z, A_y) averaged over B x D (Eq. 5) and
L_MCL = CE over -(||z - A_c|| + d* [c = y]) (Eq. 7); ``loss-form = "prototype"`` applies both to
the batch's class means as the paper writes them (L_R = sum_c ||P_c - A_c||). The margin
d* = max(margin of the anchors, margin of the client's last uploaded prototypes), the margin being
the mean nearest-neighbour distance (code) or ``margin = "pairwise"``: the sum of all pairwise
distances / (N - 1)^2 (Eq. 6 as printed). L_CC = CE of every anchor through the local head (Eq. 8). Local
prototypes: per-class means of the training-mode features seen during training (Eq. 2; the
code's ``prototype-pass = "during-train"``, or ``"post-eval"``), uploaded with the class counts.

Evaluation on the local test split with three predictors, all logged: nearest global prototype
(the paper's number, ``inference = "prototype"``), nearest anchor, and the classifier head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import GLOBAL_PROTOTYPES, ClassVectors
from protofl.settings import ExperimentSettings, KeptModel, MethodOptions
from protofl.task.inference import head_prediction, nearest_prototype
from protofl.task.models import MODEL_FAMILIES, SeededDraws
from protofl.task.prototypes import aggregate_prototypes
from protofl.task.statistics import PrototypePass

ANCHORS = "anchors"  # A, C x D, broadcast in the fit and evaluate config
PROTO_AGGS = {"mean": "uniform", "weighted": "count"}  # -> aggregate_prototypes' weighting
LOSS_KEYS = ("regularization-loss", "margin-contrastive-loss", "calibration-loss")  # L_R, L_MCL, L_CC


@dataclass(frozen=True)
class FedSAOptions(MethodOptions):
    keeps_model: ClassVar[KeptModel] = "trains"  # the personal model
    keeps_client_state: ClassVar[bool] = True  # and its margin
    lambda_r: float = 10.0  # lambda_1; the paper writes 0.1, every official script runs 10 with this MSE form
    lambda_mcl: float | Literal["auto"] = "auto"  # lambda_2: "auto" = 0.01 for one architecture, 1.0 for a family
    lambda_cc: float = 1.0  # lambda_3
    ema: float = 0.9999  # alpha of Eq. 10; 1 keeps the anchors fixed
    anchor_init: Literal["projected", "random"] = "projected"
    proto_agg: Literal["mean", "weighted"] = "mean"
    prototype_pass: PrototypePass = "during-train"
    inference: Literal["prototype", "anchor", "head"] = "prototype"
    loss_form: Literal["sample", "prototype"] = "sample"
    margin: Literal["nearest", "pairwise"] = "nearest"

    @property
    def capturable(self) -> bool:
        return self.loss_form == "sample"  # the paper's form takes the batch's classes (unique: a sync)

    def check(self) -> None:
        if min(self.lambda_r, self.lambda_cc, 0.0 if self.lambda_mcl == "auto" else self.lambda_mcl) < 0:
            raise ValueError("fedsa: the loss weights must be >= 0")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"fedsa.ema must be in (0, 1], got {self.ema}")

    def shares(self, name: str) -> bool:
        return False  # prototypes only: every client may run its own architecture

    def resolved(self, settings: ExperimentSettings) -> dict[str, float]:
        return {"lambda-mcl": self.mcl_weight(settings)} if self.lambda_mcl == "auto" else {}

    def mcl_weight(self, settings: ExperimentSettings) -> float:
        """lambda_2: the paper's 0.01 under statistical heterogeneity only, 1.0 with a model family."""
        if self.lambda_mcl == "auto":
            return 1.0 if settings.model in MODEL_FAMILIES else 0.01
        return float(self.lambda_mcl)


# --- math -------------------------------------------------------------------------------


def initial_anchors(num_classes: int, dim: int, seed: int, projected: bool = True) -> np.ndarray:
    """A^0 (C x D float32): N(0, I) class vectors, through an untrained Linear-BN-ReLU x2 embedding
    (PyTorch's default init; the BatchNorms standardise each dimension across the C vectors, as in
    training mode) with ``projected``, else raw. The same seed gives the same anchors; drawn in the
    official code's order (the embedding, then the vectors), so seed 0 gives the anchors of every
    run of that code (tests/test_conformance_fedsa.py)."""
    with SeededDraws(seed), torch.no_grad():
        embedding = nn.Sequential(
            nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
            nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
        ) if projected else None
        anchors = torch.randn(num_classes, dim)
        if embedding is not None:
            anchors = embedding.train()(anchors)
    return anchors.numpy().astype(np.float32)


def nearest_neighbour_margin(vectors: torch.Tensor) -> float | None:
    """Mean over the rows of the Euclidean distance to the nearest other row (the code's margin
    statistic, spec 2.2); None with fewer than two rows."""
    if len(vectors) < 2:
        return None
    distances = torch.cdist(vectors.double(), vectors.double())
    distances.fill_diagonal_(float("inf"))
    return float(distances.min(dim=1).values.mean())


def pairwise_margin(vectors: torch.Tensor) -> float | None:
    """The paper's Eq. 6: the sum of the distances over all ordered pairs / (N - 1)^2; None for N < 2."""
    if len(vectors) < 2:
        return None
    return float(torch.cdist(vectors.double(), vectors.double()).sum() / (len(vectors) - 1) ** 2)


MARGINS = {"nearest": nearest_neighbour_margin, "pairwise": pairwise_margin}


def batch_class_means(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the classes in the batch, their mean features), differentiable: the paper's per-batch P_c."""
    classes, index = labels.unique(return_inverse=True)
    sums = features.new_zeros(len(classes), features.shape[1]).index_add(0, index, features)
    return classes, sums / torch.bincount(index).unsqueeze(1).to(features.dtype)


def ema_update(anchors: np.ndarray, prototypes: np.ndarray, mask: np.ndarray, alpha: float) -> np.ndarray:
    """A_c <- alpha A_c + (1 - alpha) P_c for the classes in ``mask``; the others keep theirs (Eq. 10)."""
    updated = anchors.astype(np.float64)
    updated[mask] = alpha * updated[mask] + (1.0 - alpha) * prototypes[mask].astype(np.float64)
    return updated.astype(anchors.dtype)


def anchor_regularization(features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """L_R: squared distance of each feature to its class anchor, averaged over B x D (Eq. 5, code form)."""
    return F.mse_loss(features, anchors[labels])


def margin_contrastive_loss(
    features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, margin: float
) -> torch.Tensor:
    """L_MCL: cross-entropy over the negative distances to every anchor, the own class's distance
    enlarged by the margin d* (Eq. 7, per sample; no temperature, no normalisation)."""
    squared = (features**2).sum(1, keepdim=True) - 2 * features @ anchors.t() + (anchors**2).sum(1)
    distances = squared.clamp_min(1e-12).sqrt()
    distances = distances + margin * F.one_hot(labels, len(anchors)).to(distances.dtype)
    return F.cross_entropy(-distances, labels)


def anchor_calibration_loss(head: nn.Module, anchors: torch.Tensor) -> torch.Tensor:
    """L_CC: every anchor through the local head must be classified as its class (Eq. 8)."""
    return F.cross_entropy(head(anchors), torch.arange(len(anchors), device=anchors.device))


# --- server -----------------------------------------------------------------------------


class FedSAStrategy(ServerRule):
    options_class = FedSAOptions
    loss_metrics = LOSS_KEYS
    state_fields = ("anchors", "global_prototypes")
    predictor_names = ("anchor", "head", "prototype")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initial_anchors = initial_anchors(
            self.num_classes, self.feature_dim, self.settings.seed, self.options.anchor_init == "projected"
        )
        self.anchors = self.initial_anchors
        self.global_prototypes: ClassVectors | None = None

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        prototypes = self.global_prototypes.to_config(GLOBAL_PROTOTYPES) if self.global_prototypes else {}
        return {ANCHORS: self.anchors, **prototypes}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> None:
        prototypes, mask = aggregate_prototypes(  # Eq. 3 as the code
            *stacked_statistics(updates), PROTO_AGGS[self.options.proto_agg], **self.prototype_rule
        )
        self.global_prototypes = ClassVectors(prototypes, mask)
        self.anchors = ema_update(self.anchors, prototypes, mask, self.options.ema)
        drift = np.linalg.norm(self.anchors - self.initial_anchors) / np.linalg.norm(self.initial_anchors)
        self.recorder.update(
            server_round,
            anchor_margin=nearest_neighbour_margin(torch.from_numpy(self.anchors)),
            prototype_margin=nearest_neighbour_margin(torch.from_numpy(prototypes[mask])),
            anchor_drift=float(drift),
        )


# --- client -----------------------------------------------------------------------------


PROTOTYPE_MARGIN = "prototype-margin"  # kept on the node: the margin of its last uploaded prototypes


class FedSAClient(PrototypeClient):
    options_class = FedSAOptions

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lambda_mcl = self.options.mcl_weight(self.settings)

    def receive(self, parameters, this_round):
        anchors = self.received_class_vectors(this_round, ANCHORS)
        if anchors is None:
            raise ValueError("FedSA: the server sent no anchors")
        # the wire's float32 anchors in the model's dtype: the losses mix them with its features and head
        self.anchors = torch.from_numpy(anchors).to(self.device, next(self.model.parameters()).dtype)
        self.margin = self._margin(self.anchors)
        self.received_prototypes = self.global_prototypes(this_round)

    def _margin(self, anchors: torch.Tensor) -> float:
        """d* = max(global anchor margin, this client's margin of its last uploaded prototypes)."""
        own = float(self.local_state.get(PROTOTYPE_MARGIN, 0.0))
        return max(MARGINS[self.options.margin](anchors), own)

    def _regularization_and_contrastive(self, features, labels, anchors, margin) -> tuple[torch.Tensor, torch.Tensor]:
        """L_R and L_MCL per sample (code) or on the batch's class means (paper)."""
        if self.options.loss_form == "sample":
            return (
                anchor_regularization(features, labels, anchors),
                margin_contrastive_loss(features, labels, anchors, margin),
            )
        classes, means = batch_class_means(features, labels)
        return (means - anchors[classes]).norm(dim=1).sum(), margin_contrastive_loss(means, classes, anchors, margin)

    def batch_loss(self, features, logits, labels, inputs):
        regularization, contrastive = self._regularization_and_contrastive(features, labels, self.anchors, self.margin)
        calibration = anchor_calibration_loss(self.model.head, self.anchors)
        self.record_loss(**dict(zip(LOSS_KEYS, (regularization, contrastive, calibration))))
        return (
            self.options.lambda_r * regularization
            + self.lambda_mcl * contrastive
            + self.options.lambda_cc * calibration
        )

    def step_constants(self):
        return self.margin, self.lambda_mcl

    def step_inputs(self):
        return {"anchors": self.anchors}

    def after_fit(self, statistics):
        """Keeps the model and the margin of the uploaded prototypes (Eq. 2, training-mode features)."""
        own_margin = MARGINS[self.options.margin](torch.from_numpy(statistics.means[statistics.counts > 0]))
        if own_margin is None:
            self.local_state.pop(PROTOTYPE_MARGIN, None)  # one class: no margin of its own (the code's -inf)
        else:
            self.local_state[PROTOTYPE_MARGIN] = np.float64(own_margin)
        return {}

    def predictors(self):
        anchors = self.anchors
        predictors = {
            "anchor": lambda f, _logits: nearest_prototype(f, anchors, torch.ones_like(anchors[:, 0], dtype=bool)),
            "head": head_prediction,
        }
        if self.received_prototypes is not None:
            predictors["prototype"] = lambda f, _logits: nearest_prototype(f, *self.received_prototypes)
        return predictors


STRATEGY, CLIENT = FedSAStrategy, FedSAClient
